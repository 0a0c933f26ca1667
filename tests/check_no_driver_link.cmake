# cmake -DREADELF=<readelf> -DBINARIES=<a;b;...> -P check_no_driver_link.cmake
#
# Fails when a binary records the CUDA driver library (libcuda.so*) among its
# dynamic dependencies: moeforge opens the driver at run time, so that its
# binaries start, and run their CPU paths, on machines without a GPU driver.
foreach(binary IN LISTS BINARIES)
  execute_process(COMMAND ${READELF} -d ${binary} OUTPUT_VARIABLE dynamic RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "readelf -d ${binary} failed (${rc})")
  endif()
  string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*" needed "${dynamic}")
  if(NOT needed)
    message(FATAL_ERROR "readelf -d ${binary} lists no NEEDED entries: not a dynamically linked binary?")
  endif()
  foreach(line IN LISTS needed)
    if(line MATCHES "libcuda\\.so")
      message(FATAL_ERROR "${binary} needs the CUDA driver library (${line}): link NVRTC and cuBLAS by their "
                          "library files (backends/cuda/CMakeLists.txt), never CUDA::cuda_driver")
    endif()
  endforeach()
  list(LENGTH needed count)
  message(STATUS "${binary}: ${count} dynamic dependencies, no libcuda")
endforeach()
