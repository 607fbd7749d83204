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
