#!/bin/bash
# mpilb on one workstation with mpiexec: rank 0 serves, the other ranks train.
#
#   jobs/mpirun/local.sh [CONFIG.toml] [mpilb train options...]
#   MPILB_NP=4 jobs/mpirun/local.sh --data digits --model mlp --epochs 5
#
# The arguments are those of `mpilb train` and win over the variables:
#   MPILB_NP        number of ranks (default: the cores, at least 2; rank 0 only serves)
#   MPILB_CONFIG    TOML config file
#   MPILB_DATA      dataset directory (from `mpilb prepare`)
#   MPILB_LOG       run log (default: mpilb-local-<date>.h5 here)
#   MPILB_DEVICE    --device (default: auto: the GPUs CuPy sees, else the CPU)
#   MPILB_MPIEXEC   the launcher (default: mpiexec on PATH; it must belong to the MPI that
#                   mpi4py uses: `mpilb doctor` shows which one that is)
#   MPILB_SURVIVE   1: a worker process that dies does not end the job (MPICH's
#                   `mpiexec -disable-auto-cleanup` and `--survive-signals`, so that a
#                   rank killed by a signal does not make Hydra kill the rest; Open MPI 4's
#                   `mpirun --mca orte_abort_on_non_zero_status 0` and `--survive-signals`, so
#                   that mpirun exits 3, not 137, for one killed); rank 0 declares it lost after
#                   --worker-timeout, its work goes to the others, exit 3 (docs/faults.md).
#                   Open MPI 5 has `mpirun --with-ft ulfm` for this (not tested with mpilb)
set -euo pipefail

np=${MPILB_NP:-$(nproc 2>/dev/null || echo 2)}
if (( np < 2 )); then
    np=2
fi

# mpilb sets one BLAS thread per rank itself; the cores are shared by the ranks.
args=()
if [[ -n ${MPILB_CONFIG:-} ]]; then args+=("$MPILB_CONFIG"); fi
if [[ -n ${MPILB_DATA:-} ]]; then args+=(--data "$MPILB_DATA"); fi
args+=(--device "${MPILB_DEVICE:-auto}" --log "${MPILB_LOG:-mpilb-local-$(date +%Y%m%d-%H%M%S).h5}" "$@")

echo "mpilb: $np ranks on $(hostname): mpilb train ${args[*]}"
# exec: Ctrl-C and signals (SIGTERM, SIGUSR1: checkpoint and stop) go straight to mpiexec,
# which passes them on to every rank.
launcher=("${MPILB_MPIEXEC:-mpiexec}")
if [[ ${MPILB_SURVIVE:-0} == 1 ]]; then
    if "${launcher[0]}" --version 2>/dev/null | grep -q "Open MPI\|OpenRTE"; then
        launcher+=(--mca orte_abort_on_non_zero_status 0)   # Open MPI 4: the others run on
        args+=(--survive-signals)   # a rank killed by signal N would make mpirun exit 128 + N
    else
        # The survivors of a death get SIGUSR1 from Hydra: mpilb tells that notice from a
        # preemption (a preemption only if every worker is heard from again before any is lost).
        launcher+=(-disable-auto-cleanup)
        args+=(--survive-signals)
    fi
fi
exec "${launcher[@]}" -n "$np" mpilb train "${args[@]}"
