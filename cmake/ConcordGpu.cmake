# Resolves CONCORD_WITH_CUDA / CONCORD_WITH_NCCL (AUTO|ON|OFF) into
# CONCORD_HAVE_CUDA / CONCORD_HAVE_NCCL. The image keeps the toolkit and NCCL
# under /usr/local/cuda; AUTO builds them when found, never requires them.
set(CONCORD_HAVE_CUDA OFF)
set(CONCORD_HAVE_NCCL OFF)

if(NOT CONCORD_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    # nvcc's host compiler can be older than the C++ compiler (Debian 13:
    # CUDA 12.4 needs g++-13, the system compiler is GCC 14). CMake adds the
    # CUDA toolchain's implicit link directories to every link that has CUDA
    # objects, GCC 13's among them, whose libstdc++.so then shadows the
    # system's (links fail on __cxa_call_terminate). The C++ driver links
    # with its own GCC's directories; drop the host compiler's.
    list(FILTER CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES EXCLUDE REGEX "/gcc/")
    find_package(CUDAToolkit REQUIRED)
    set(CONCORD_HAVE_CUDA ON)
  elseif(CONCORD_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "CONCORD_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

if(NOT CONCORD_WITH_NCCL STREQUAL "OFF" AND CONCORD_HAVE_CUDA)
  # NCCL_ROOT (a CMake or environment variable) names an NCCL outside the
  # toolkit: <root>/include and <root>/lib, e.g. pip's nvidia-nccl-cu13 package
  # directory, whose lib/ holds libnccl.so.2 without the unversioned link.
  find_path(NCCL_INCLUDE_DIR nccl.h
    HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include
    PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
    HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64
    PATH_SUFFIXES lib lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    add_library(concord_nccl_lib INTERFACE)
    target_include_directories(concord_nccl_lib SYSTEM INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(concord_nccl_lib INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
    set(CONCORD_HAVE_NCCL ON)
  endif()
endif()
if(CONCORD_WITH_NCCL STREQUAL "ON" AND NOT CONCORD_HAVE_NCCL)
  message(FATAL_ERROR "CONCORD_WITH_NCCL=ON but CUDA or NCCL was not found")
endif()
message(STATUS "Concord: CUDA kernels ${CONCORD_HAVE_CUDA}, NCCL communicator ${CONCORD_HAVE_NCCL}")
