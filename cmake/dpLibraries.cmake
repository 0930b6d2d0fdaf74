# The libraries dp's static library links by file rather than through a CMake package (OpenBLAS;
# oneDNN, whose package would demand the OpenCL headers of a GPU runtime dp never uses; and, with the
# cuda backend, the CUDA runtime, cuBLAS, NCCL and cuDNN), as imported targets dp::<name>. dp's own
# build finds them here, and an installed package's dpConfig.cmake finds them again on the
# consumer's machine: no absolute path of the build machine travels with the package, and a
# consumer is asked for the CUDA libraries only, never for the CUDA toolkit (nvcc).
macro(dp_import_library name)
  if(NOT TARGET dp::${name})
    find_library(DP_${name}_LIBRARY ${ARGN} REQUIRED)
    add_library(dp::${name} UNKNOWN IMPORTED)
    set_target_properties(dp::${name} PROPERTIES IMPORTED_LOCATION "${DP_${name}_LIBRARY}")
  endif()
endmacro()

# DP_HAVE_CUDA: whether dp was built with the cuda backend; DP_CUDA_LIBRARY_DIRS: where its build
# found the CUDA libraries, the first place to look.
macro(dp_import_libraries)
  dp_import_library(openblas NAMES openblas)
  dp_import_library(dnnl NAMES dnnl)
  if(DP_HAVE_CUDA)
    foreach(dp_cuda_library cudart cublas nccl cudnn)
      dp_import_library(${dp_cuda_library} NAMES ${dp_cuda_library}
                        HINTS ${DP_CUDA_LIBRARY_DIRS} /usr/local/cuda/lib64 /usr/local/cuda/lib)
    endforeach()
  endif()
endmacro()
