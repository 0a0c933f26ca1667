# The installable library (issue 18): `cmake --install <build> --prefix P`
# puts the public headers under P/include/moeforge/..., the static libraries
# under P/lib and a CMake package under P/lib/cmake/moeforge, so that
#
#   find_package(moeforge REQUIRED)            # or COMPONENTS cpu / cuda
#   target_link_libraries(app PRIVATE moeforge::moeforge moeforge::cpu)
#
# works in another project (examples/consumer/ is one; scripts/check_install.sh
# builds it against an installed tree in CI). A project that adds this tree
# with add_subdirectory gets the same names as aliases.
#
#   moeforge::moeforge  the algebra, schedules, the Eigen reference, lowering
#                       and the runtime (#include <moeforge/moeforge.h>)
#   moeforge::cpu       the LLVM CPU backend (CpuLayer, CpuTrainingLayer),
#                       where LLVM was found; needs LLVM where it is used
#   moeforge::cuda      the CUDA backend (CudaLayer, TrainingLayer), where the
#                       CUDA toolkit was found; needs the toolkit where used
#                       (NVRTC, cuBLAS and the toolkit's headers are recorded
#                       by the absolute paths this build found them at)
#   moeforge::examples  the example layers (make_example("moe_mlp", ...))
#
# Include paths: the sources include each other as "dsl/...", "backends/..."
# (relative to the repository root), so the installed P/include/moeforge is on
# the targets' include path besides P/include (for <moeforge/moeforge.h>).
# A later change gives every include a moeforge/ prefix and drops the former.
#
# Included by the top-level CMakeLists.txt after every library is defined.

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MOEFORGE_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/moeforge)
set(MOEFORGE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/moeforge)

# The umbrella target. (`moeforge` itself is the CLI's executable.)
add_library(moeforge_library INTERFACE)
target_link_libraries(moeforge_library INTERFACE moeforge_dsl moeforge_schedules moeforge_lowering moeforge_tensor
                                                 moeforge_reference moeforge_routing moeforge_runtime)
add_library(moeforge::moeforge ALIAS moeforge_library)
add_library(moeforge::examples ALIAS moeforge_examples)

# Users' code compiles as C++20 too (the headers need it).
target_compile_features(moeforge_dsl PUBLIC cxx_std_20)

# Exported names: moeforge::<name>.
set_target_properties(moeforge_library PROPERTIES EXPORT_NAME moeforge)
set(MOEFORGE_CORE_LIBRARIES moeforge_dsl moeforge_schedules moeforge_lowering moeforge_tensor moeforge_reference
                            moeforge_routing moeforge_runtime moeforge_examples)
foreach(lib IN LISTS MOEFORGE_CORE_LIBRARIES)
  string(REPLACE "moeforge_" "" name ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${name})
endforeach()

# Public header folders, relative to the repository root.
set(MOEFORGE_HEADER_DIRS dsl schedules lowering runtime backends backends/reference examples)

# The backends: the umbrella header includes a backend's layer API where its
# target is linked (the definition travels with the target).
set(MOEFORGE_COMPONENTS "")
if(TARGET moeforge_cpu)
  list(APPEND MOEFORGE_COMPONENTS cpu)
  list(APPEND MOEFORGE_HEADER_DIRS backends/cpu)
  add_library(moeforge::cpu ALIAS moeforge_cpu)
  set_target_properties(moeforge_cpu PROPERTIES EXPORT_NAME cpu)
  target_compile_definitions(moeforge_cpu INTERFACE MOEFORGE_HAVE_CPU_BACKEND=1)
endif()
if(TARGET moeforge_cuda_layer)
  list(APPEND MOEFORGE_COMPONENTS cuda)
  list(APPEND MOEFORGE_HEADER_DIRS backends/cuda/codegen backends/cuda/runtime backends/cuda/tune
       backends/cuda/parallel)
  add_library(moeforge::cuda ALIAS moeforge_cuda_layer)
  set_target_properties(moeforge_cuda_layer PROPERTIES EXPORT_NAME cuda)
  set_target_properties(moeforge_cuda PROPERTIES EXPORT_NAME cuda_driver)
  target_compile_definitions(moeforge_cuda_layer INTERFACE MOEFORGE_HAVE_CUDA=1)
endif()

# --- install rules ---------------------------------------------------------

# Each folder's own headers (not its subfolders: backends/cuda/device/ is
# embedded at build time, examples/consumer/ is a project of its own).
foreach(dir IN LISTS MOEFORGE_HEADER_DIRS)
  file(GLOB headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${dir}/*.h)
  install(FILES ${headers} DESTINATION ${MOEFORGE_INSTALL_INCLUDEDIR}/${dir})
endforeach()
# The umbrella header: include/moeforge/moeforge.h -> P/include/moeforge/moeforge.h.
install(FILES ${PROJECT_SOURCE_DIR}/include/moeforge/moeforge.h DESTINATION ${MOEFORGE_INSTALL_INCLUDEDIR})

install(TARGETS moeforge_library ${MOEFORGE_CORE_LIBRARIES} EXPORT moeforgeTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(EXPORT moeforgeTargets NAMESPACE moeforge:: DESTINATION ${MOEFORGE_INSTALL_CMAKEDIR})
if(TARGET moeforge_cpu)
  install(TARGETS moeforge_cpu EXPORT moeforgeCpuTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT moeforgeCpuTargets NAMESPACE moeforge:: DESTINATION ${MOEFORGE_INSTALL_CMAKEDIR})
endif()
if(TARGET moeforge_cuda_layer)
  install(TARGETS moeforge_cuda moeforge_cuda_layer EXPORT moeforgeCudaTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT moeforgeCudaTargets NAMESPACE moeforge:: DESTINATION ${MOEFORGE_INSTALL_CMAKEDIR})
endif()
# The CLI, for `moeforge list`, `print`, `run` beside your own program; it
# keeps the paths of the shared libraries it was linked with (libLLVM, NVRTC).
set_target_properties(moeforge PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS moeforge RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# What the package config needs to find again where it is used.
set(MOEFORGE_BUILT_LLVM_DIR "${LLVM_DIR}")
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/moeforgeConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/moeforgeConfig.cmake INSTALL_DESTINATION ${MOEFORGE_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API, so only the same minor version matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/moeforgeConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/moeforgeConfig.cmake ${PROJECT_BINARY_DIR}/moeforgeConfigVersion.cmake
        DESTINATION ${MOEFORGE_INSTALL_CMAKEDIR})
