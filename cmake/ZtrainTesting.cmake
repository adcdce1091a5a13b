# One helper registers every test.
#
#   ztrain_add_test(NAME comm_test SOURCES a.cpp b.cpp [RANKS 1 2 4] [TIMEOUT 120] [LABELS ...]
#                   [ARGS ...] [ENV VAR=value ...] [NO_INIT] [GPU] [NCCL])
#
# Every test of a directory is built into one program, <directory>_tests (tests/comm/*.cpp ->
# comm_tests, a unity build linked with GoogleTest and the shared MPI-aware test main): each
# translation unit that includes libtorch costs some 25 s of compiler time before its own code, so
# one program per directory instead of one per test about halves the build of the tests (the
# compile steps under tests/ on a 2-core machine: 1373 s with 36 test and 5 fuzz programs, 739 s
# with 10 and 1). Each test runs only the suites its own SOURCES define (a --gtest_filter made
# from their TEST, TEST_F and TEST_P lines; a --gtest_filter in ARGS that excludes (-X) narrows
# it, one that selects replaces it). ENV adds to the test's environment. ztrain_test_program(var
# dir) names the program for launches registered by hand.
#
# Without RANKS a test is a unit test run as a plain process (world size 1). With RANKS it is
# registered once per rank count as NAME.npN, launched under mpirun; the test main receives the
# expected world size in ZTRAIN_TEST_WORLD_SIZE and fails when it does not get it, so a launcher
# mistake can never pass silently. NO_INIT (ZTRAIN_TEST_NO_INIT=1 in the test's environment)
# leaves init_distributed to the test itself (tests of initialisation). GPU registers every launch
# once more as NAME[.npN].cuda with ZTRAIN_DEVICE=cuda (the runtime's device; several ranks share
# the GPUs there are) and the label gpu: `ctest -L gpu` (scripts/gpu_check.sh). NCCL (in builds
# with the nccl backend) registers each multi-rank launch once more as NAME.npN.nccl, on the GPU
# with ZTRAIN_BACKEND=nccl and the labels gpu and nccl; each rank gets its own NCCL_HOSTID
# (tests/support/nccl_rank.sh), so that ranks sharing one GPU — as on a one-GPU test machine —
# may form an NCCL communicator. Where no CUDA device is visible those report as skipped, never
# as passed; on a machine without an NVIDIA device node they skip without starting
# (tests/support/gpu_gate.sh).
include_guard(GLOBAL)

find_package(GTest REQUIRED)
find_program(ZTRAIN_MPIEXEC NAMES mpirun mpiexec REQUIRED)

# GLIBC_TUNABLES: glibc's malloc keeps freed memory up to 32 MiB a block instead of unmapping it
# and faulting fresh zeroed pages in at the next allocation; the tests allocate and free the same
# large tensors over and over, and spent more time in the kernel than in their own code
# (communicator_test.np4: 81 s, 111 s of it system time, before; 59 s after).
set(ZTRAIN_TEST_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296
  ZTRAIN_TIMEOUT_S=60)

# Options every multi-rank launch in the tests uses: more ranks than cores, no core binding (the
# ranks of an oversubscribed run would otherwise be packed onto the same core).
set(ZTRAIN_MPIEXEC_FLAGS --oversubscribe --bind-to none)

# The test program of a test directory (its last path component): tests/ckpt -> ckpt_tests.
function(ztrain_test_program var dir)
  get_filename_component(name ${dir} NAME)
  set(${var} ${name}_tests PARENT_SCOPE)
endfunction()

# The --gtest_filter that selects every suite SOURCES define (TEST_P suites under any
# instantiation prefix).
function(ztrain_test_filter var)
  set(patterns "")
  foreach(source IN LISTS ARGN)
    file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/${source} lines REGEX "^TEST(_F|_P)?\\([A-Za-z0-9_]+,")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^TEST(_F|_P)?\\(([A-Za-z0-9_]+),.*" "\\2" suite "${line}")
      if(line MATCHES "^TEST_P")
        list(APPEND patterns "*/${suite}.*")
      else()
        list(APPEND patterns "${suite}.*")
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES patterns)
  if(NOT patterns)
    message(FATAL_ERROR "${ARGN}: no TEST, TEST_F or TEST_P found")
  endif()
  string(JOIN ":" filter ${patterns})
  set(${var} ${filter} PARENT_SCOPE)
endfunction()

function(ztrain_add_test)
  cmake_parse_arguments(T "NO_INIT;GPU;NCCL" "NAME;TIMEOUT" "SOURCES;RANKS;LABELS;ARGS;ENV" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  ztrain_test_program(program ${CMAKE_CURRENT_SOURCE_DIR})
  if(NOT TARGET ${program})
    add_executable(${program})
    target_link_libraries(${program} PRIVATE ztrain_test_main ztrain_warnings)
    if(ZTRAIN_USE_PCH)
      target_precompile_headers(${program} REUSE_FROM ztrain_test_main)
    endif()
  endif()
  target_sources(${program} PRIVATE ${T_SOURCES})

  ztrain_test_filter(filter ${T_SOURCES})
  set(args "")
  foreach(arg IN LISTS T_ARGS)
    if(arg MATCHES "^--gtest_filter=-(.*)")
      set(filter "${filter}-${CMAKE_MATCH_1}")
    elseif(arg MATCHES "^--gtest_filter=(.*)")
      set(filter "${CMAKE_MATCH_1}")
    else()
      list(APPEND args ${arg})
    endif()
  endforeach()
  set(command $<TARGET_FILE:${program}> --gtest_filter=${filter} ${args})
  set(base_env ${ZTRAIN_TEST_ENV} ${T_ENV})
  if(T_NO_INIT)
    list(APPEND base_env ZTRAIN_TEST_NO_INIT=1)
  endif()

  set(devices cpu)
  if(T_GPU)
    list(APPEND devices cuda)
  endif()
  if(T_NCCL AND ZTRAIN_HAS_NCCL)
    list(APPEND devices nccl)
  endif()
  foreach(device IN LISTS devices)
    set(suffix "")
    set(env "")
    set(labels "${T_LABELS}")
    set(skip "")
    set(wrapper "")
    set(gate "")
    if(NOT device STREQUAL "cpu")
      set(gate ${PROJECT_SOURCE_DIR}/tests/support/gpu_gate.sh)
      set(skip SKIP_REGULAR_EXPRESSION "sees no CUDA device")
    endif()
    if(device STREQUAL "cuda")
      set(suffix ".cuda")
      set(env ";ZTRAIN_DEVICE=cuda")
      list(APPEND labels gpu)
    elseif(device STREQUAL "nccl")
      set(suffix ".nccl")
      set(env ";ZTRAIN_DEVICE=cuda;ZTRAIN_BACKEND=nccl")
      list(APPEND labels gpu nccl)
      set(wrapper ${PROJECT_SOURCE_DIR}/tests/support/nccl_rank.sh)
    endif()
    if(NOT T_RANKS AND NOT device STREQUAL "nccl")
      add_test(NAME ${T_NAME}${suffix} COMMAND ${gate} ${command})
      set_tests_properties(${T_NAME}${suffix} PROPERTIES
        TIMEOUT ${T_TIMEOUT} LABELS "unit;${labels}"
        ENVIRONMENT "${base_env};ZTRAIN_TEST_WORLD_SIZE=1${env}" ${skip})
    endif()
    foreach(n IN LISTS T_RANKS)
      add_test(NAME ${T_NAME}.np${n}${suffix}
        COMMAND ${gate} ${ZTRAIN_MPIEXEC} -np ${n} ${ZTRAIN_MPIEXEC_FLAGS} ${wrapper} ${command})
      set_tests_properties(${T_NAME}.np${n}${suffix} PROPERTIES
        TIMEOUT ${T_TIMEOUT} LABELS "mpi;${labels}" PROCESSORS ${n}
        ENVIRONMENT "${base_env};ZTRAIN_TEST_WORLD_SIZE=${n}${env}" ${skip})
    endforeach()
  endforeach()
endfunction()
