# `cmake --install BUILD --prefix P`: the tools, and the programmer's API —
# libconcord.so, its public headers and a CMake package — so that another
# project writes `find_package(Concord)` and links `Concord::concord`.
#
# Layout (docs/install.md):
#   P/bin/                    concord-coordinator, concord-run, concord-train,
#                             concordctl
#   P/lib/                    libconcord.so (and its versioned names)
#   P/include/concord/        the public headers: concord.h and what it
#                             includes (LibTorch's headers and nothing else)
#   P/lib/cmake/Concord/      ConcordConfig.cmake, ConcordConfigVersion.cmake,
#                             ConcordTargets*.cmake
#
# What is inside libconcord.so (the worker library, gRPC, Protobuf, OpenSSL,
# Abseil, Gloo, NCCL) is linked privately: the package needs only LibTorch.
# The build tree itself is not exported (no export(EXPORT)/export(PACKAGE)):
# find_package(Concord) can only find an installed prefix.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(CONCORD_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Concord)

set_target_properties(concord PROPERTIES EXPORT_NAME concord
  INSTALL_RPATH_USE_LINK_PATH ON)
add_library(Concord::concord ALIAS concord)
install(TARGETS concord EXPORT ConcordTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

# The tools. Libraries found outside the system paths at link time (NCCL
# under /usr/local/cuda) stay findable from the installed binaries.
set(_concord_tools concord-coordinator concord-run concord-train concordctl)
set_target_properties(${_concord_tools} PROPERTIES
  INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS ${_concord_tools}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

# Headers: the public ones only.
install(DIRECTORY ${CMAKE_SOURCE_DIR}/include/concord
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT development
  FILES_MATCHING PATTERN "*.h")

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
