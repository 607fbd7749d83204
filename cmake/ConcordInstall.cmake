# `cmake --install BUILD --prefix P`: the tools, the worker library with the
# libraries it needs, its public headers and a CMake package, so that another
# project writes `find_package(Concord)` and links `Concord::worker`.
#
# Layout (docs/install.md):
#   P/bin/                    concord-coordinator, concord-run, concord-train,
#                             concordctl
#   P/lib/                    libconcord.a (Concord::worker) and the static
#                             libraries it needs (common, proto, worker_core,
#                             kernels)
#   P/include/concord/        the include root: worker/..., common/...,
#                             kernels/..., concord/config.h, concord/v1/*.pb.h,
#                             so `#include "worker/session.h"` works as in the
#                             build tree
#   P/lib/cmake/Concord/      ConcordConfig.cmake, ConcordConfigVersion.cmake,
#                             ConcordTargets*.cmake
#
# The build tree itself is not exported (no export(EXPORT)/export(PACKAGE)):
# find_package(Concord) can only find an installed prefix.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(CONCORD_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/concord)
set(CONCORD_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Concord)

# Exported names: Concord::<name>. The same names work in the build tree.
set(_concord_exported
  concord_proto proto
  concord_common common
  concord_trace trace
  concord_worker_core worker_core
  concord_kernels_cpu kernels_cpu
  concord worker)
if(CONCORD_HAVE_CUDA)
  list(APPEND _concord_exported concord_kernels_cuda kernels_cuda)
endif()
if(CONCORD_HAVE_NCCL)
  list(APPEND _concord_exported concord_nccl_lib nccl)
endif()
set(_concord_targets)
while(_concord_exported)
  list(POP_FRONT _concord_exported target name)
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
  add_library(Concord::${name} ALIAS ${target})
  list(APPEND _concord_targets ${target})
endwhile()

install(TARGETS ${_concord_targets} EXPORT ConcordTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
  INCLUDES DESTINATION ${CONCORD_INSTALL_INCLUDEDIR})

# The tools. Libraries found outside the system paths at link time (NCCL
# under /usr/local/cuda) stay findable from the installed binaries.
set(_concord_tools concord-coordinator concord-run concord-train concordctl)
set_target_properties(${_concord_tools} PROPERTIES
  INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS ${_concord_tools}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

# Headers: every header of the installed libraries (the public ones include
# each other, the generated ones and common/), under the include root.
install(DIRECTORY ${CMAKE_SOURCE_DIR}/worker ${CMAKE_SOURCE_DIR}/common
    ${CMAKE_SOURCE_DIR}/kernels
  DESTINATION ${CONCORD_INSTALL_INCLUDEDIR} COMPONENT development
  FILES_MATCHING PATTERN "*.h"
  PATTERN "nccl" EXCLUDE)
if(CONCORD_HAVE_NCCL)
  install(FILES ${CMAKE_SOURCE_DIR}/worker/comm/nccl/nccl_communicator.h
    DESTINATION ${CONCORD_INSTALL_INCLUDEDIR}/worker/comm/nccl
    COMPONENT development)
endif()
install(FILES ${CMAKE_BINARY_DIR}/generated/concord/config.h
  DESTINATION ${CONCORD_INSTALL_INCLUDEDIR}/concord COMPONENT development)
get_target_property(_concord_proto_gen concord_proto CONCORD_GENERATED_DIR)
install(DIRECTORY ${_concord_proto_gen}/concord
  DESTINATION ${CONCORD_INSTALL_INCLUDEDIR} COMPONENT development
  FILES_MATCHING PATTERN "*.pb.h")

install(EXPORT ConcordTargets NAMESPACE Concord::
  DESTINATION ${CONCORD_INSTALL_CMAKEDIR} COMPONENT development)
configure_package_config_file(cmake/ConcordConfig.cmake.in
  ${CMAKE_BINARY_DIR}/ConcordConfig.cmake
  INSTALL_DESTINATION ${CONCORD_INSTALL_CMAKEDIR})
# 0.x: a new minor version may break the API.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/ConcordConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/ConcordConfig.cmake
    ${CMAKE_BINARY_DIR}/ConcordConfigVersion.cmake
  DESTINATION ${CONCORD_INSTALL_CMAKEDIR} COMPONENT development)
