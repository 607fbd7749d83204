# Defines the `gloo` target that worker/ links (after find_package(Torch)).
#
# Note [Gloo next to pip's LibTorch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Concord calls Gloo itself (worker/comm/gloo). Debian's LibTorch, 12's and
# 13's, is built against Debian's libgloo, so a process holds one Gloo:
# find_package(Gloo CONFIG), the default. pip's LibTorch builds its own Gloo
# (third_party/gloo, a static library, GLOO_INSTALL OFF in PyTorch's
# cmake/Dependencies.cmake) into libtorch_cpu.so with default visibility, so
# libtorch_cpu.so exports gloo:: symbols, and its wheel lists no gloo headers to
# ship. Two Gloos of different versions in one process share their symbol names:
# the dynamic linker binds each gloo:: symbol to the first loaded library that
# defines it, whoever calls it, so the library that wins must be the one the
# caller's headers describe. Two arrangements keep that true:
#
# - CONCORD_GLOO_FROM_TORCH=ON: LibTorch's Gloo only, where LibTorch ships
#   its headers (<torch include>/gloo/config.h): compiled against them, the
#   symbols taken from libtorch_cpu.so. One Gloo, as on Debian. Configuring
#   fails when the headers are not there.
# - OFF (default): Debian's libgloo, linked ahead of LibTorch
#   (worker/CMakeLists.txt), so that executables load it first and Concord's
#   calls reach the Gloo its headers describe. LibTorch's own Gloo code would
#   bind to Debian's too where names coincide; only ProcessGroupGloo runs it,
#   which Concord never uses. Listed after LibTorch, libgloo would lose every
#   shared name to LibTorch's copy, and with GCC's --as-needed (Ubuntu's
#   default) it would be dropped from the link altogether.
#
# A program linking libconcord.so (api/CMakeLists.txt) loads LibTorch in
# its own right, and the dynamic linker searches a program's own libraries
# before those of the libraries it loads, so libconcord.so's calls into
# Gloo would bind to LibTorch's copy however libconcord.so itself was
# linked (a SIGSEGV in the first collective, seen on pip's LibTorch 2.11).
# With OFF, Concord::concord therefore puts Debian's libgloo on the
# program's link line ahead of LibTorch, kept by --no-as-needed although the
# program calls none of it (concord_gloo_first).
#
# scripts/gpu-suite.sh chooses ON when the wheel has the headers and
# libtorch_cpu.so exports gloo:: symbols, OFF otherwise.
option(CONCORD_GLOO_FROM_TORCH
  "Use the Gloo inside LibTorch (its headers, libtorch_cpu's symbols) instead of find_package(Gloo)"
  OFF)

if(CONCORD_GLOO_FROM_TORCH)
  find_path(CONCORD_TORCH_GLOO_INCLUDE_DIR gloo/config.h
    PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  if(NOT CONCORD_TORCH_GLOO_INCLUDE_DIR)
    message(FATAL_ERROR "CONCORD_GLOO_FROM_TORCH=ON but LibTorch ships no "
      "Gloo headers (no gloo/config.h under ${TORCH_INCLUDE_DIRS})")
  endif()
  add_library(gloo INTERFACE IMPORTED)
  set_target_properties(gloo PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CONCORD_TORCH_GLOO_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${TORCH_LIBRARIES}")
  message(STATUS "Concord: Gloo from LibTorch (${CONCORD_TORCH_GLOO_INCLUDE_DIR}/gloo)")
else()
  find_package(Gloo CONFIG REQUIRED)
endif()

# Link items that make a program linking libconcord.so load Debian's libgloo
# ahead of LibTorch (see Note [Gloo next to pip's LibTorch]): the library's
# file with --no-as-needed, then --as-needed; nothing with
# CONCORD_GLOO_FROM_TORCH. A path rather than the gloo target, so that the
# installed package needs no find_package(Gloo).
function(concord_gloo_first out)
  set(items)
  if(NOT CONCORD_GLOO_FROM_TORCH)
    get_target_property(file gloo IMPORTED_LOCATION)
    if(NOT file)
      get_target_property(configs gloo IMPORTED_CONFIGURATIONS)
      foreach(config IN LISTS configs)
        get_target_property(file gloo IMPORTED_LOCATION_${config})
        if(file)
          break()
        endif()
      endforeach()
    endif()
    if(NOT file)
      message(FATAL_ERROR "Concord: the gloo target names no library file")
    endif()
    # As LibTorch's own package names libtorch_cpu.so (one item each: CMake
    # may drop a repeated flag).
    set(items "-Wl,--no-as-needed,${file}" "-Wl,--as-needed")
  endif()
  set(${out} "${items}" PARENT_SCOPE)
endfunction()
