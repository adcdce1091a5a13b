"""pytest runs each test file as `python3 FILE` does: the runtime started first by the file's
init_distributed(), once per process — so one file per process, as ctest runs them (under mpirun
for several ranks)."""
import pytest


def pytest_collection_finish(session):
    modules = {item.getparent(pytest.Module).obj for item in session.items}
    if len(modules) > 1:
        raise pytest.UsageError("the runtime starts once per process: run one test file at a time "
                                f"(got {', '.join(sorted(m.__name__ for m in modules))})")
    for module in modules:
        module.init_distributed()
