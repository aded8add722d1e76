# The compiler settings and system libraries every build of kvq's C++ shares: the repository's
# own build (CMakeLists.txt at the root) and the Python package's native module
# (client/python/CMakeLists.txt), so that format/, kernels/ and core/ compile the same way in
# both and the module's codes are the server's bit for bit. Included before those folders are
# added; a build that includes it may set KVQ_WERROR beforehand (option() keeps a variable set).
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)

find_program(CCACHE_PROGRAM ccache)
if(CCACHE_PROGRAM)
  set(CMAKE_C_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${CCACHE_PROGRAM})
endif()

option(KVQ_NATIVE_ISA "Compile with -march=native (off: portable binary, ISA chosen at run time)" OFF)

# The libraries scripts/install-deps.sh installs (Debian packages).
find_package(absl REQUIRED)
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
find_package(nlohmann_json REQUIRED)
find_package(Threads REQUIRED)

add_compile_options(-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
# Warnings in kvq's own C and C++ are errors (generated protobuf code is built with -w; CUDA
# keeps nvcc's defaults). GCC 12 reports three kinds of false positive inside libstdc++ when it
# inlines std::string/std::vector copies (-Wrestrict, -Wstringop-overflow: GCC bugs 105329,
# 105651) and std::function members of temporaries (-Wmaybe-uninitialized: a default
# ServerOptions argument, say) into our code: those stay warnings, so a real one still shows in
# the build log, and clang's builds (fuzzers, TSan) keep their uninitialized checks as errors.
option(KVQ_WERROR "Treat compiler warnings in kvq's code as errors" ON)
if(KVQ_WERROR)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Werror>)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Wno-error=restrict>
                        $<$<COMPILE_LANGUAGE:C,CXX>:-Wno-error=stringop-overflow>
                        $<$<COMPILE_LANGUAGE:C,CXX>:-Wno-error=maybe-uninitialized>)
  elseif(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    # grpc_cpp_plugin's WithRawCallbackMethod_* classes hide the typed method they replace, in
    # the generated header itself, wherever a service is included (the fuzzers' server build).
    add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-Wno-error=overloaded-virtual>)
  endif()
endif()
if(KVQ_NATIVE_ISA)
  add_compile_options(-march=native)
endif()
