#!/usr/bin/env bash
# Usage: pip_install_test.sh PYTHON ROOT BUILD
# `pip install .` of the source tree (build isolation on, nothing downloaded) into a directory of
# its own, reusing the configured build directory; the installed package imports and works from
# there alone: the extension and the ztrain libraries it loads are the installed copies.
set -euo pipefail
python=$1 root=$2 build=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ZTRAIN_BUILD_DIR=$build "$python" -m pip install --quiet --no-deps --no-index --target "$tmp/site" "$root"
ls "$tmp/site/ztrain/.libs"
cd "$tmp"
env -u PYTHONPATH PYTHONPATH="$tmp/site" ZTRAIN_TEST_SITE="$tmp/site" "$python" - <<'PY'
import os, torch, ztrain
site = os.environ["ZTRAIN_TEST_SITE"]
assert ztrain.__file__.startswith(site), ztrain.__file__
loaded = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libztrain_" in line})
assert loaded and all(p.startswith(os.path.join(site, "ztrain", ".libs")) for p in loaded), loaded
ztrain.init_distributed(seed=0)
w = torch.nn.Parameter(torch.ones(5))
ref = torch.nn.Parameter(torch.ones(5))
opt, torch_opt = ztrain.optim.AdamW([w], lr=0.1, weight_decay=0.0), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
for p, o in ((w, opt), (ref, torch_opt)):
    (p * torch.arange(5.0)).sum().backward()
    o.step()
assert torch.allclose(w, ref, atol=1e-6), (w, ref)
print(f"pip_install_test: ztrain {ztrain.__file__}, {len(loaded)} libraries from .libs, AdamW step as torch's")
PY
