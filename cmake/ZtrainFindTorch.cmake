# Finds libtorch (2.x) for ztrain and for projects that use the installed package.
#
# Where libtorch is, in order: Torch_DIR or CMAKE_PREFIX_PATH when given (any libtorch build or
# PyTorch installation: -DCMAKE_PREFIX_PATH=$(python -c 'import torch.utils;
# print(torch.utils.cmake_prefix_path)')); else the torch of ZTRAIN_PYTHON, asked for its
# torch.utils.cmake_prefix_path. ZTRAIN_PYTHON defaults to the project environment that
# scripts/setup.sh makes (.venv), else the python3 on PATH.
#
# PyPI's torch is a CUDA build, and its CMake files probe the GPU when no architecture list is
# given; machines without one (and CMake 3.25's probe) then fail, so a list is given here.
set(TORCH_CUDA_ARCH_LIST "8.0;9.0" CACHE STRING "CUDA architectures for libtorch's CUDA flags")

if(NOT ZTRAIN_PYTHON)
  if(EXISTS ${PROJECT_SOURCE_DIR}/.venv/bin/python)
    set(python ${PROJECT_SOURCE_DIR}/.venv/bin/python)
  else()
    find_program(python NAMES python3)
  endif()
  set(ZTRAIN_PYTHON ${python} CACHE FILEPATH
      "Python with PyTorch 2.x: locates libtorch, computes golden values, runs the peer benchmarks")
endif()

# TorchConfig looks for its libraries in CMAKE_PREFIX_PATH and the system's directories before its
# own: another libtorch there (Debian's libtorch-dev) would be linked with these headers. So the
# installation is located first (Torch_DIR, or a TorchConfig.cmake under a CMAKE_PREFIX_PATH entry
# in either layout: PyTorch's cmake_prefix_path or a libtorch archive's root), goes first in
# CMAKE_PREFIX_PATH while it is loaded, and the library found is checked below.
set(ztrain_user_prefix_path "${CMAKE_PREFIX_PATH}")
if(NOT Torch_DIR)
  foreach(prefix IN LISTS CMAKE_PREFIX_PATH)
    foreach(dir ${prefix}/Torch ${prefix}/share/cmake/Torch)
      if(NOT Torch_DIR AND EXISTS ${dir}/TorchConfig.cmake)
        set(Torch_DIR ${dir} CACHE PATH "libtorch's CMake package" FORCE)
      endif()
    endforeach()
  endforeach()
endif()
macro(ztrain_find_torch_in torch_dir)
  get_filename_component(ztrain_torch_root ${torch_dir}/../../.. ABSOLUTE)
  set(CMAKE_PREFIX_PATH ${ztrain_torch_root} ${ztrain_user_prefix_path})
  find_package(Torch 2.0 QUIET CONFIG)
endmacro()

if(Torch_DIR)
  ztrain_find_torch_in(${Torch_DIR})
else()
  find_package(Torch 2.0 QUIET CONFIG)
endif()
if(NOT Torch_FOUND AND ZTRAIN_PYTHON)
  execute_process(
    COMMAND ${ZTRAIN_PYTHON} -c "import torch.utils; print(torch.utils.cmake_prefix_path, end='')"
    OUTPUT_VARIABLE torch_cmake_prefix RESULT_VARIABLE torch_rc ERROR_QUIET)
  if(torch_rc EQUAL 0)
    set(Torch_DIR ${torch_cmake_prefix}/Torch CACHE PATH "libtorch's CMake package" FORCE)
    ztrain_find_torch_in(${Torch_DIR})
  endif()
endif()
set(CMAKE_PREFIX_PATH "${ztrain_user_prefix_path}")
if(NOT Torch_FOUND)
  message(FATAL_ERROR "libtorch 2.x not found: run scripts/setup.sh (a PyTorch in .venv), or pass "
          "-DZTRAIN_PYTHON=<a python with torch 2.x> or -DCMAKE_PREFIX_PATH=<torch.utils.cmake_prefix_path>")
endif()
get_filename_component(torch_lib_dir ${TORCH_LIBRARY} DIRECTORY)
if(NOT torch_lib_dir STREQUAL "${TORCH_INSTALL_PREFIX}/lib")
  message(FATAL_ERROR "libtorch's headers are from ${TORCH_INSTALL_PREFIX} but its library is "
          "${TORCH_LIBRARY}: add ${TORCH_INSTALL_PREFIX} to CMAKE_PREFIX_PATH")
endif()
