# Installs the dp build into a scratch prefix, then configures, builds and runs tests/consumer; then
# the same consumer against the build tree itself (no install), configured, built and run.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${DP_BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc COMMAND_ECHO STDOUT)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
# The package names no file of the build machine: it finds its libraries on the consumer's.
file(GLOB targets ${WORK_DIR}/prefix/lib*/cmake/dp/dpTargets*.cmake)
foreach(file IN LISTS targets)
  file(READ ${file} text)
  if(text MATCHES "(/usr/[^;\"]*|/opt/[^;\"]*)\\.(so|a)")
    message(FATAL_ERROR "${file} links a file by its absolute path: ${CMAKE_MATCH_0}")
  endif()
endforeach()
# As on a machine without nvcc: a package built with the cuda backend must not ask for the toolkit.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
                        -DCUSTOM_MODEL_SOURCE=${CUSTOM_MODEL_SOURCE} -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/dp_consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/custom_model ${WORK_DIR}/custom_model.safetensors 12 RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the custom-model example failed: ${rc}")
endif()
if(NOT EXISTS ${WORK_DIR}/custom_model.safetensors)
  message(FATAL_ERROR "the custom-model example saved no checkpoint")
endif()
# The build tree as the package: find_package(dp) with the build directory as the prefix.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE} -B ${WORK_DIR}/build-tree -G ${GENERATOR}
                        -DCMAKE_PREFIX_PATH=${DP_BUILD_DIR} -DCMAKE_BUILD_TYPE=Release
                        -DCUSTOM_MODEL_SOURCE=${CUSTOM_MODEL_SOURCE} -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer against the build tree failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build-tree RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer against the build tree failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build-tree/dp_consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer built against the build tree failed: ${rc}")
endif()
