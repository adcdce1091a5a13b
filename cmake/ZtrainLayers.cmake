# The layer rule, checked when the project is configured (and by `cmake -P` on this file):
# a header or source of one area includes headers of its own area and of areas below it only.
#
#   core < comm < runtime < optim < zero < tp < pipe < ckpt < booster < models
#
# The libraries enforce the same order at link time (src/CMakeLists.txt); this check also
# catches what the linker cannot see: an inline function or template of a higher area.
# ztrain/ztrain.h, the umbrella for users, is included by no library file.

set(ZTRAIN_LAYER_ORDER core comm runtime optim zero tp pipe ckpt booster models)

# The area of a path relative to the source tree, or of an included "ztrain/..." header.
function(ztrain_area_of path out)
  set(area "")
  if(path MATCHES "^(include/)?ztrain/(error|version|torch_compat|cpu_matmul16)\\.h$" OR path MATCHES "^src/(error\\.cpp|cpu_matmul16\\.cpp|host_memory\\.(h|cpp)|bf16_avx2\\.h)$")
    set(area core)
  elseif(path MATCHES "^(include/)?ztrain/ztrain\\.h$")
    set(area umbrella)
  elseif(path MATCHES "^(include/)?ztrain/([a-z_]+)/")
    set(area ${CMAKE_MATCH_2})
  elseif(path MATCHES "^src/([a-z_]+)/")
    set(area ${CMAKE_MATCH_1})
  endif()
  set(${out} ${area} PARENT_SCOPE)
endfunction()

function(ztrain_check_layers root)
  file(GLOB_RECURSE files RELATIVE ${root} ${root}/include/ztrain/*.h ${root}/src/*.h ${root}/src/*.cpp)
  set(violations "")
  foreach(file IN LISTS files)
    ztrain_area_of(${file} own)
    list(FIND ZTRAIN_LAYER_ORDER "${own}" own_rank)
    if(own_rank LESS 0)
      continue()  # the umbrella header
    endif()
    get_filename_component(dir ${file} DIRECTORY)
    file(STRINGS ${root}/${file} lines REGEX "^#include [<\"]")
    foreach(line IN LISTS lines)
      set(target "")
      if(line MATCHES "^#include [<\"](ztrain/[^>\"]+)[>\"]")
        ztrain_area_of(${CMAKE_MATCH_1} target)
        set(header ${CMAKE_MATCH_1})
      elseif(line MATCHES "^#include \"([^\"]+)\"")
        set(header ${CMAKE_MATCH_1})
        get_filename_component(resolved ${root}/${dir}/${header} ABSOLUTE)
        file(RELATIVE_PATH resolved ${root} ${resolved})
        ztrain_area_of(${resolved} target)
      endif()
      if(target STREQUAL "")
        continue()
      endif()
      list(FIND ZTRAIN_LAYER_ORDER "${target}" target_rank)
      if(target_rank LESS 0 OR target_rank GREATER own_rank)
        string(APPEND violations "\n  ${file} (${own}) includes ${header} (${target})")
      endif()
    endforeach()
  endforeach()
  if(violations)
    message(FATAL_ERROR "ztrain's layers are core < comm < runtime < optim < zero < tp < pipe < ckpt < booster < models; "
                        "these includes reach a higher layer:${violations}")
  endif()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE)
  get_filename_component(ZTRAIN_ROOT ${CMAKE_CURRENT_LIST_DIR}/.. ABSOLUTE)
  ztrain_check_layers(${ZTRAIN_ROOT})
  message(STATUS "ztrain layers: every include stays in its layer or below")
endif()
