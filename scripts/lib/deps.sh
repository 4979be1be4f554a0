# shellcheck shell=bash
# Dependency helpers shared by the scripts in scripts/.  Source, don't run.
#
#   ovq_ensure_deps PKG...           make sure the Debian packages are present
#   ovq_ensure_optional_deps PKG...  same, but never fails
#   ovq_required_packages            print the packages a build needs
#   ovq_optional_packages            print nice-to-have packages
#   ovq_fuzz_packages                print what scripts/fuzz needs on top (clang, libFuzzer)
#
# Packages are Debian/Ubuntu names.  Missing ones are installed with apt-get
# when running as root; otherwise the exact command to run is printed on
# stderr.  Set OVQ_SKIP_DEPS=1 to skip all of this (e.g. on a non-Debian
# system where the dependencies were installed by other means).

# Is the dependency behind Debian package $1 already available?  Looks at the
# thing itself where that is cheap (a command, a header) and at dpkg otherwise,
# so that self-built installs in /usr/local also count.
ovq__have() {
  local pkg=$1
  case "$pkg" in
    cmake) command -v cmake >/dev/null 2>&1 && return 0 ;;
    make) command -v make >/dev/null 2>&1 && return 0 ;;
    ninja-build) command -v ninja >/dev/null 2>&1 && return 0 ;;
    g++) command -v g++ >/dev/null 2>&1 && return 0 ;;
    clang) command -v clang++ >/dev/null 2>&1 && return 0 ;;
    libeigen3-dev)
      [[ -f /usr/include/eigen3/Eigen/Core || -f /usr/local/include/eigen3/Eigen/Core ]] && return 0 ;;
    catch2)
      [[ -f /usr/local/include/catch2/catch.hpp || -f /usr/local/include/catch2/catch_all.hpp ]] && return 0 ;;
    python3-numpy)
      [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import numpy' >/dev/null 2>&1 && return 0 ;;
    libbenchmark-dev)
      [[ -f /usr/local/include/benchmark/benchmark.h ]] && return 0 ;;
    libclang-rt-dev)
      # libFuzzer's runtime, wherever this clang looks for it.
      if command -v clang++ >/dev/null 2>&1; then
        local rt
        rt=$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null) || rt=
        [[ "$rt" == /* && -f "$rt" ]] && return 0
      fi
      ;;
  esac
  ovq__dpkg_installed "$pkg"
}

ovq__dpkg_installed() {
  command -v dpkg-query >/dev/null 2>&1 || return 1
  local status
  status=$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) || return 1
  [[ "$status" == "install ok installed" ]]
}

# ovq__install STRICT PKG...: install the packages, or explain how to.
ovq__install() {
  local strict=$1
  shift
  (($# > 0)) || return 0
  if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "ovq: installing missing packages: $*" >&2
    if apt-get update &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"; then
      return 0
    fi
    echo "ovq: apt-get failed to install: $*" >&2
    [[ "$strict" == 1 ]] && return 1
    return 0
  fi
  if [[ "$strict" == 1 ]]; then
    echo "ovq: missing dependencies: $*" >&2
    echo "ovq: install them with:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends $*" >&2
    echo "ovq: (or set OVQ_SKIP_DEPS=1 if they are installed some other way)" >&2
    return 1
  fi
  echo "ovq: optional packages not installed: $* (sudo apt-get install -y $*)" >&2
  return 0
}

ovq__missing() {
  local pkg
  for pkg in "$@"; do
    ovq__have "$pkg" || printf '%s\n' "$pkg"
  done
}

ovq_ensure_deps() {
  [[ "${OVQ_SKIP_DEPS:-0}" == 1 ]] && return 0
  local missing
  mapfile -t missing < <(ovq__missing "$@")
  ((${#missing[@]} == 0)) && return 0
  ovq__install 1 "${missing[@]}" || return 1
  # Re-check, so a package that apt "installed" but that is still unusable
  # is reported here rather than as a confusing CMake error.
  mapfile -t missing < <(ovq__missing "${missing[@]}")
  if ((${#missing[@]} > 0)); then
    echo "ovq: still missing after install: ${missing[*]}" >&2
    return 1
  fi
}

ovq_ensure_optional_deps() {
  [[ "${OVQ_SKIP_DEPS:-0}" == 1 ]] && return 0
  local missing
  mapfile -t missing < <(ovq__missing "$@")
  ((${#missing[@]} == 0)) && return 0
  ovq__install 0 "${missing[@]}"
}

# Is the C++ compiler that CMake will pick (CXX, else c++/g++) clang?
ovq__cxx_is_clang() {
  local cxx=${CXX:-}
  [[ -n "$cxx" ]] || return 1
  [[ "$(basename -- "${cxx%% *}")" == clang* ]]
}

ovq_required_packages() {
  local pkgs=(cmake)
  # CMake's default generator on Linux is Unix Makefiles.
  if [[ -z "${CMAKE_GENERATOR:-}" || "${CMAKE_GENERATOR}" == *Makefiles* ]]; then
    pkgs+=(make)
  elif [[ "${CMAKE_GENERATOR}" == Ninja* ]]; then
    pkgs+=(ninja-build)
  fi
  if ovq__cxx_is_clang; then
    pkgs+=(clang)
  elif [[ -n "${CXX:-}" ]]; then
    : # some other compiler chosen explicitly: trust it
  elif ! command -v c++ >/dev/null 2>&1; then
    pkgs+=(g++)
  fi
  pkgs+=(libeigen3-dev catch2 libbenchmark-dev)
  printf '%s\n' "${pkgs[@]}"
}

ovq_optional_packages() {
  # g++ ships OpenMP (libgomp); clang needs LLVM's runtime.
  if ovq__cxx_is_clang; then
    printf '%s\n' libomp-dev
  fi
}

# libFuzzer (scripts/fuzz): clang and its sanitizer/fuzzer runtimes. GCC's sanitizer runtimes
# (libasan, libubsan, libtsan, used by scripts/test) come with g++ itself.
ovq_fuzz_packages() {
  printf '%s\n' clang libclang-rt-dev
}

# Install whatever the default build needs.
ovq_ensure_build_deps() {
  local req opt
  mapfile -t req < <(ovq_required_packages)
  mapfile -t opt < <(ovq_optional_packages)
  ovq_ensure_deps "${req[@]}" || return 1
  if ((${#opt[@]} > 0)); then
    ovq_ensure_optional_deps "${opt[@]}"
  fi
}

ovq_nproc() {
  nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2
}
