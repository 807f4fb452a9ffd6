#!/usr/bin/env bash
# install-deps.sh — install what shardlm needs on Debian/Ubuntu; do nothing when
# everything is already there (so `make run` / `make test` can call it always).
#
# Slurm (slurm-wlm, munge) is installed for the Slurm test suite only where no
# Slurm is there yet; a cluster's own Slurm is left alone.
#
# On clusters, dependencies come from modules: set SHARDLM_NO_INSTALL=1 (or just
# load the modules; when everything is found nothing is installed) and point the
# Makefile at them (MPICXX=, HDF5_DIR=, BLAS_LIBS=, ...).
#
#   tools/install-deps.sh           check, install what is missing
#   tools/install-deps.sh --check   check only; exit 1 and list what is missing
set -euo pipefail

check_only=0
[ "${1:-}" = "--check" ] && check_only=1

missing=()    # Debian package names
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_pc() { have_cmd pkg-config && pkg-config --exists "$1"; }
need() { missing+=("$@"); }

have_cmd pkg-config || need pkg-config
have_cmd make || need make
have_cmd g++ || need g++
{ have_cmd "${MPICXX:-mpicxx}" && have_cmd mpirun; } || need libopenmpi-dev openmpi-bin
[ -n "${HDF5_DIR:-}" ] || have_pc hdf5-openmpi || need libhdf5-openmpi-dev
have_cmd h5dump || need hdf5-tools
have_pc tomlplusplus || [ -f /usr/include/toml++/toml.h ] || need libtomlplusplus-dev
[ -f /usr/include/doctest/doctest.h ] || [ -n "${DOCTEST_DIR:-}" ] || need doctest-dev
# OpenBLAS on OpenMP (not pthreads): it shares shardlm's OpenMP threads.
[ -n "${BLAS_LIBS:-}" ] || ls /usr/lib/*/openblas-openmp/pkgconfig/openblas.pc >/dev/null 2>&1 || need libopenblas-openmp-dev
have_pc nlohmann_json || [ -f /usr/include/nlohmann/json.hpp ] || need nlohmann-json3-dev
have_pc libpcre2-8 || [ -f /usr/include/pcre2.h ] || need libpcre2-dev  # the tokenizer's pre-tokenizer regex
/usr/bin/python3 -c 'import h5py, numpy' >/dev/null 2>&1 || need python3-h5py python3-numpy
/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1 || need python3-matplotlib  # tools/plot_runs.py
# Real tokenizers and chat templates (tools/hf_tokenizer.py, tools/chat_template.py).
/usr/bin/python3 -c 'import regex' >/dev/null 2>&1 || need python3-regex
/usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1 || need python3-jinja2
# The tokenizer test's references (tools/install-node-deps.sh: npm ci into tools/node).
{ have_cmd node && have_cmd npm; } || need nodejs npm
# The real-text deck's corpus (inputs/text-sft.toml, tools/make_text_data.sh).
{ command -v bible >/dev/null 2>&1 && [ -f /usr/lib/bible.data ]; } || need bible-kjv
# Slurm: tests/scripts/test_slurm.sh starts a single-node cluster of its own
# (slurmctld, slurmd, munged; the packages' system services are not used) and
# submits jobs/*.sbatch to it; srun --mpi=pmix loads libpmix.so from libpmix-dev.
# A machine with sbatch but no slurmctld is a cluster's login or compute node: its
# site Slurm stays as it is (the suite then skips), nothing is installed over it.
if ! have_cmd sbatch || have_cmd slurmctld; then
  { have_cmd slurmctld && have_cmd slurmd && have_cmd sbatch && have_cmd srun; } || need slurm-wlm
  { have_cmd munged && have_cmd mungekey; } || need munge
  ls /usr/lib/*/pmix2/lib/libpmix.so >/dev/null 2>&1 || need libpmix-dev
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "shardlm: missing dependencies: ${missing[*]}" >&2
if [ $check_only = 1 ] || [ -n "${SHARDLM_NO_INSTALL:-}" ]; then
  exit 1
fi
if ! have_cmd apt-get; then
  echo "shardlm: no apt-get here; install the equivalents of the packages above (or load modules) and" >&2
  echo "         point the Makefile at them (MPICXX=, HDF5_DIR=, BLAS_LIBS=)" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if have_cmd sudo; then SUDO="sudo"; else
    echo "shardlm: not root and no sudo; as root run: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi
echo "shardlm: installing with apt-get: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "shardlm: dependencies installed" >&2
