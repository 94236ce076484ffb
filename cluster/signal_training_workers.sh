#!/bin/sh
# Preemption notice for raytrain-ext on this machine: SIGTERM to every training worker
# process (Ray sets their title to "ray::TrainWorker..."), nothing else.
#
# Why: a TrainWorker that receives SIGTERM asks every rank for an emergency checkpoint at the
# next step boundary, written within checkpoint.preemption_grace_s, and the run ends PREEMPTED
# (exit code 3); `checkpoint.resume=auto` (the default) resumes it with zero steps redone.
# Signalling the workers directly does not depend on how PID 1 of a container forwards
# signals, so a Kubernetes preStop hook and the AWS spot watcher both call this script.
#
# Invariant: only processes whose command line starts with "ray::TrainWorker" are signalled;
# reads /proc so it needs no procps (pkill is missing from minimal images).
# Prints the pids it signalled; exits 0 even when there are none (nothing to checkpoint).
for proc_dir in /proc/[0-9]*; do
    cmdline=$(tr '\0' ' ' < "$proc_dir/cmdline" 2>/dev/null) || continue
    case "$cmdline" in
        "ray::TrainWorker"*)
            pid=${proc_dir#/proc/}
            kill -TERM "$pid" 2>/dev/null && echo "SIGTERM -> training worker pid $pid"
            ;;
    esac
done
exit 0
