# concord_grpc_library(NAME PROTO...): a static library of the protoc and
# gRPC C++ output of the .proto files (paths relative to, and imports
# resolved from, the current source directory), generated under the current
# binary directory's gen/ (a SYSTEM include directory of the library in the
# build tree, named by the target's CONCORD_GENERATED_DIR property so that
# cmake/ConcordInstall.cmake can install the headers).
function(concord_grpc_library name)
  add_library(${name} STATIC ${ARGN})
  target_link_libraries(${name} PUBLIC protobuf::libprotobuf gRPC::grpc++)
  set(gen ${CMAKE_CURRENT_BINARY_DIR}/gen)
  file(MAKE_DIRECTORY ${gen})
  target_include_directories(${name} SYSTEM PUBLIC $<BUILD_INTERFACE:${gen}>)
  set_target_properties(${name} PROPERTIES CONCORD_GENERATED_DIR ${gen})
  get_target_property(plugin gRPC::grpc_cpp_plugin LOCATION)
  protobuf_generate(TARGET ${name} LANGUAGE cpp
    IMPORT_DIRS ${CMAKE_CURRENT_SOURCE_DIR} PROTOC_OUT_DIR ${gen})
  protobuf_generate(TARGET ${name} LANGUAGE grpc
    GENERATE_EXTENSIONS .grpc.pb.h .grpc.pb.cc
    PLUGIN "protoc-gen-grpc=${plugin}"
    IMPORT_DIRS ${CMAKE_CURRENT_SOURCE_DIR} PROTOC_OUT_DIR ${gen})
endfunction()
