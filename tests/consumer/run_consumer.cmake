# Driver for the consumer_* CTest tests.  Run with cmake -P:
#
#   -DMODE=find_package|add_subdirectory
#   -DOVQ_SOURCE_DIR=<ovq source tree>
#   -DWORK_DIR=<private scratch directory, wiped on each run>
#   -DCXX_COMPILER=<C++ compiler>            (optional)
#   -DGENERATOR=<CMake generator>            (optional, plus GENERATOR_PLATFORM,
#                                             GENERATOR_TOOLSET, MAKE_PROGRAM)
#   -DBUILD_CONFIG=<Release|Debug|...>       (optional, default Release)
#   -DEIGEN3_DIR=<dir with Eigen3Config.cmake> (optional)
#   -DPREFIX_PATH=<a|b|c>                    (optional, '|'-separated)
#
# find_package:      configure ovq (tests/bench/examples off), build, install
#                    into WORK_DIR/prefix, then build and run
#                    tests/consumer/find_package against that prefix.
# add_subdirectory:  build and run tests/consumer/add_subdirectory, which pulls
#                    ovq in with add_subdirectory().
cmake_minimum_required(VERSION 3.16)

foreach(_var MODE OVQ_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${_var}=... is required")
  endif()
endforeach()
if(NOT MODE MATCHES "^(find_package|add_subdirectory)$")
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()
if(NOT BUILD_CONFIG)
  set(BUILD_CONFIG Release)
endif()

set(_consumer_src "${OVQ_SOURCE_DIR}/tests/consumer/${MODE}")
set(_prefix "${WORK_DIR}/prefix")

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# Arguments shared by every configure step.
set(_common_args "-DCMAKE_BUILD_TYPE=${BUILD_CONFIG}")
if(GENERATOR)
  list(APPEND _common_args -G "${GENERATOR}")
  if(GENERATOR_PLATFORM)
    list(APPEND _common_args -A "${GENERATOR_PLATFORM}")
  endif()
  if(GENERATOR_TOOLSET)
    list(APPEND _common_args -T "${GENERATOR_TOOLSET}")
  endif()
  if(MAKE_PROGRAM)
    list(APPEND _common_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
endif()
if(CXX_COMPILER)
  list(APPEND _common_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(EIGEN3_DIR)
  list(APPEND _common_args "-DEigen3_DIR=${EIGEN3_DIR}")
endif()

# Run one step; on failure show its output and stop.
function(ovq_step name)
  message(STATUS "[${MODE}] ${name}")
  execute_process(
    COMMAND ${ARGN}
    WORKING_DIRECTORY "${WORK_DIR}"
    RESULT_VARIABLE _rc
    OUTPUT_VARIABLE _out
    ERROR_VARIABLE _out)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "[${MODE}] step '${name}' failed (${_rc}):\n${_out}")
  endif()
endfunction()

if(MODE STREQUAL "find_package")
  string(REPLACE "|" ";" _prefix_path "${PREFIX_PATH}")
  list(INSERT _prefix_path 0 "${_prefix}")
  string(REPLACE ";" "\\;" _prefix_path_arg "${_prefix_path}")

  ovq_step("configure ovq"
    "${CMAKE_COMMAND}" -S "${OVQ_SOURCE_DIR}" -B "${WORK_DIR}/ovq-build"
    ${_common_args}
    "-DCMAKE_INSTALL_PREFIX=${_prefix}"
    -DOVQ_BUILD_TESTS=OFF -DOVQ_BUILD_BENCHMARKS=OFF -DOVQ_BUILD_EXAMPLES=OFF)
  ovq_step("build ovq"
    "${CMAKE_COMMAND}" --build "${WORK_DIR}/ovq-build" --config "${BUILD_CONFIG}")
  ovq_step("install ovq"
    "${CMAKE_COMMAND}" --install "${WORK_DIR}/ovq-build" --config "${BUILD_CONFIG}")

  foreach(_f
      "include/ovq/ovq.hpp"
      "share/cmake/ovq/ovqConfig.cmake"
      "share/cmake/ovq/ovqConfigVersion.cmake"
      "share/cmake/ovq/ovqTargets.cmake")
    if(NOT EXISTS "${_prefix}/${_f}")
      message(FATAL_ERROR "[${MODE}] installed tree lacks ${_f}")
    endif()
  endforeach()

  ovq_step("configure consumer"
    "${CMAKE_COMMAND}" -S "${_consumer_src}" -B "${WORK_DIR}/consumer-build"
    ${_common_args}
    "-DCMAKE_PREFIX_PATH=${_prefix_path_arg}")
else()
  ovq_step("configure consumer"
    "${CMAKE_COMMAND}" -S "${_consumer_src}" -B "${WORK_DIR}/consumer-build"
    ${_common_args}
    "-DOVQ_SOURCE_DIR=${OVQ_SOURCE_DIR}")
endif()

ovq_step("build consumer"
  "${CMAKE_COMMAND}" --build "${WORK_DIR}/consumer-build" --config "${BUILD_CONFIG}")

# Locate the executable (multi-config generators put it in a per-config dir).
set(_exe "")
foreach(_cand
    "${WORK_DIR}/consumer-build/ovq_consumer"
    "${WORK_DIR}/consumer-build/ovq_consumer.exe"
    "${WORK_DIR}/consumer-build/${BUILD_CONFIG}/ovq_consumer"
    "${WORK_DIR}/consumer-build/${BUILD_CONFIG}/ovq_consumer.exe")
  if(EXISTS "${_cand}")
    set(_exe "${_cand}")
    break()
  endif()
endforeach()
if(NOT _exe)
  message(FATAL_ERROR "[${MODE}] consumer executable not found under ${WORK_DIR}/consumer-build")
endif()

ovq_step("run consumer" "${_exe}")
message(STATUS "[${MODE}] consumer OK")
