#!/usr/bin/python3
"""Integration test of concord-train's command line (and concord-run's
handling of failing workers).

    /usr/bin/python3 tests/integration/test_train_cli.py --bin-dir build/bin [--keep]

Bad inputs: concord-train must reject each one before training starts (no
coordinator needed: it is run directly, without concord-run) with exit status
2 and exactly one non-empty line on stderr that names the offending file (its
path) or flag, within 60 s, and must not write --output. The same rejection
through `concord-run --standalone --nproc 2` must make concord-run exit 2 and
show the worker's message.

Success: `concord-run --standalone --nproc 1 -- concord-train ...` writes
--output (a dict name -> tensor with the scripted module's state_dict() keys,
dtypes and shapes, readable by torch.load) and --metrics-out (JSON with
world_size, steps, step_time_ms_mean, step_time_ms_median,
samples_per_second, final_loss, and step_times_ms: [step, ms] of each step).

Prints one line per check and a final 'N passed, N failed'; exits 1 on any
failure.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))

import torch  # noqa: E402

import fixtures  # noqa: E402
import processes  # noqa: E402

CALL_TIMEOUT = 60.0


Checks = fixtures.Checks


def nonempty_lines(text):
    return [line for line in text.splitlines() if line.strip()]


def expect_rejection(checks, name, cmd, needles, output_path, one_line=True, also=()):
    """cmd must exit 2 within CALL_TIMEOUT, print one non-empty stderr line (if
    one_line) containing at least one of needles and every string in also, and
    not create output_path."""
    if output_path and os.path.exists(output_path):
        os.remove(output_path)
    r = processes.run_command(cmd, timeout=CALL_TIMEOUT)
    problems = []
    if r.timed_out:
        problems.append("did not finish within %.0f s" % CALL_TIMEOUT)
    elif r.returncode != 2:
        problems.append("exit status %s, expected 2" % r.returncode)
    lines = nonempty_lines(r.stderr)
    if one_line and len(lines) != 1:
        problems.append("%d non-empty stderr lines, expected exactly 1" % len(lines))
    if not any(n in r.stderr for n in needles):
        problems.append("stderr names none of %s" % (needles,))
    for a in also:
        if a not in r.stderr:
            problems.append("stderr does not mention %r" % a)
    if output_path and os.path.exists(output_path):
        problems.append("--output %s was written" % output_path)
    if problems:
        checks.fail(name, "; ".join(problems) + "\n" + r.describe())
    else:
        checks.ok(name, "exit 2 in %.1fs: %s" % (r.elapsed, lines[-1].strip() if lines else ""))
    return not problems


def write_bad_files(d):
    """Bad model and data files. Returns a dict name -> path."""
    os.makedirs(d, exist_ok=True)
    paths = {}
    g = torch.Generator().manual_seed(5)

    paths["random_bytes"] = os.path.join(d, "random_bytes.pt")
    with open(paths["random_bytes"], "wb") as f:
        f.write(bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()))

    paths["tensor_file"] = os.path.join(d, "a_tensor.pt")
    torch.save(torch.randn(4, 4, generator=g), paths["tensor_file"])

    x = torch.randn(24, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (24,), generator=g, dtype=torch.int64)

    paths["data_not_dict"] = os.path.join(d, "data_not_dict.pt")
    torch.save(x, paths["data_not_dict"])

    paths["data_no_targets"] = os.path.join(d, "data_no_targets.pt")
    torch.save({"inputs": x}, paths["data_no_targets"])

    # Two entries, neither 'targets' (a one-entry dict is pickled differently
    # and is covered by data_no_targets).
    paths["data_labels_not_targets"] = os.path.join(d, "data_labels_not_targets.pt")
    torch.save({"inputs": x, "labels": y}, paths["data_labels_not_targets"])

    paths["data_len_mismatch"] = os.path.join(d, "data_len_mismatch.pt")
    torch.save({"inputs": x, "targets": y[:23]}, paths["data_len_mismatch"])

    paths["data_float_targets"] = os.path.join(d, "data_float_targets.pt")
    torch.save({"inputs": x, "targets": y.to(torch.float32)}, paths["data_float_targets"])

    # For the mlp model (16 -> 4): targets with 3 columns do not match.
    xm = torch.randn(24, fixtures.MLP_IN, generator=g)
    paths["data_mse_shape"] = os.path.join(d, "data_mse_shape.pt")
    torch.save({"inputs": xm, "targets": torch.randn(24, fixtures.MLP_OUT - 1, generator=g)},
               paths["data_mse_shape"])
    return paths


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return p.parse_args()


def device_cases(checks, train, out, tmp):
    """See Note [Worker device]: --device and --backend where there is no GPU."""
    expect_rejection(checks, "--device gpu (not a device)", train(extra=["--device", "gpu"]),
                     ["--device"], out, also=["cpu, cuda, cuda:N or auto"])
    expect_rejection(checks, "--backend mpi (not a backend)",
                     train(extra=["--backend", "mpi"]), ["--backend"], out)
    expect_rejection(checks, "--backend nccl on the CPU", train(extra=["--backend", "nccl"]),
                     ["--backend nccl"], out, also=["needs a CUDA device"])
    if torch.cuda.is_available():
        checks.not_applicable("--device cuda / auto without a GPU",
                              "this machine has a CUDA device")
        return
    expect_rejection(checks, "--device cuda without a GPU", train(extra=["--device", "cuda"]),
                     ["--device cuda: no CUDA device is visible"], out)
    expect_rejection(checks, "--device cuda:1 without a GPU",
                     train(extra=["--device", "cuda:1"]),
                     ["--device cuda:1: no CUDA device is visible"], out)
    r = processes.run_command(train(), timeout=CALL_TIMEOUT,
                             env={"CONCORD_DEVICE": "cuda"})
    checks.check(r.returncode == 2 and len(nonempty_lines(r.stderr)) == 1
                 and "CONCORD_DEVICE: device cuda: no CUDA device" in r.stderr,
                 "CONCORD_DEVICE=cuda without a GPU: one line, exit 2", r.describe())
    # auto: trains on the CPU, says so exactly once, and trains what cpu does.
    states = {}
    for device in ("cpu", "auto"):
        path = os.path.join(tmp, "device-" + device, "final.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cmd = [c if c != out else path for c in train(extra=["--device", device])]
        r = processes.run_command(cmd, timeout=120)
        said = [line for line in nonempty_lines(r.stderr) if "--device auto" in line]
        if device == "auto":
            checks.check(r.returncode == 0 and len(said) == 1
                         and "no CUDA device is visible" in said[0]
                         and "training on the CPU" in said[0],
                         "--device auto without a GPU: trains on the CPU, said once",
                         r.describe())
        if r.returncode == 0 and os.path.isfile(path):
            states[device] = fixtures.load_state(path)
    if len(states) == 2:
        problems = fixtures.compare_states(states["auto"], states["cpu"], rtol=0, atol=0)
        checks.check(not problems, "--device auto without a GPU trains what --device cpu does",
                     "; ".join(problems[:5]))


def run(args, checks, tmp):
    bin_dir = os.path.abspath(args.bin_dir)
    run_bin = os.path.join(bin_dir, "concord-run")
    train_bin = os.path.join(bin_dir, "concord-train")
    missing = [b for b in (run_bin, train_bin) if not os.access(b, os.X_OK)]
    if missing:
        checks.fail("concord binaries present", "not found or not executable: %s" % missing)
        return

    cnn_model, cnn_data = fixtures.make_fixture(os.path.join(tmp, "cnn"), "cnn", 40, 11)
    mlp_model, mlp_data = fixtures.make_fixture(os.path.join(tmp, "mlp"), "mlp", 24, 12)
    bad = write_bad_files(os.path.join(tmp, "bad"))
    out = os.path.join(tmp, "out", "final.pt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    nowhere = os.path.join(tmp, "does_not_exist", "model.pt")
    nowhere_data = os.path.join(tmp, "does_not_exist", "data.pt")

    def train(model=cnn_model, data=cnn_data, loss="cross_entropy", extra=(), drop=()):
        flags = [("--model", model), ("--data", data), ("--loss", loss),
                 ("--optimizer", "sgd"), ("--lr", "0.01"), ("--batch-size", "8"),
                 ("--epochs", "1"), ("--output", out)]
        cmd = [train_bin]
        for k, v in flags:
            if k not in drop:
                cmd += [k, v]
        return cmd + list(extra)

    # --- bad files, concord-train run directly ---------------------------
    expect_rejection(checks, "missing --model file", train(model=nowhere), [nowhere], out)
    expect_rejection(checks, "--model is random bytes", train(model=bad["random_bytes"]),
                     [bad["random_bytes"]], out)
    expect_rejection(checks, "--model is a torch.save'd tensor, not TorchScript",
                     train(model=bad["tensor_file"]), [bad["tensor_file"]], out)
    expect_rejection(checks, "missing --data file", train(data=nowhere_data), [nowhere_data], out)
    expect_rejection(checks, "--data is random bytes", train(data=bad["random_bytes"]),
                     [bad["random_bytes"]], out)
    expect_rejection(checks, "--data is a tensor, not a dict", train(data=bad["data_not_dict"]),
                     [bad["data_not_dict"]], out)
    expect_rejection(checks, "--data lacks 'targets'", train(data=bad["data_no_targets"]),
                     [bad["data_no_targets"]], out)
    expect_rejection(checks, "--data has 'labels' instead of 'targets'",
                     train(data=bad["data_labels_not_targets"]),
                     [bad["data_labels_not_targets"]], out, also=["targets"])
    expect_rejection(checks, "--data inputs/targets length mismatch",
                     train(data=bad["data_len_mismatch"]), [bad["data_len_mismatch"]], out)
    # Incompatibility between model output and targets: the message may name
    # either file.
    expect_rejection(checks, "cross_entropy with float targets",
                     train(data=bad["data_float_targets"]),
                     [bad["data_float_targets"], cnn_model], out)
    expect_rejection(checks, "mse with output/target shape mismatch",
                     train(model=mlp_model, data=bad["data_mse_shape"], loss="mse"),
                     [bad["data_mse_shape"], mlp_model], out)

    # --- bad flags ----------------------------------------------------------
    expect_rejection(checks, "unknown flag", train(extra=["--no-such-flag", "1"]),
                     ["no-such-flag"], out)
    expect_rejection(checks, "--epochs 0", train(drop=("--epochs",), extra=["--epochs", "0"]),
                     ["epochs"], out)
    expect_rejection(checks, "negative --batch-size",
                     train(drop=("--batch-size",), extra=["--batch-size", "-4"]),
                     ["batch-size", "batch_size"], out)
    expect_rejection(checks, "--batch-size 0",
                     train(drop=("--batch-size",), extra=["--batch-size", "0"]),
                     ["batch-size", "batch_size"], out)
    expect_rejection(checks, "unknown --loss", train(loss="hinge"), ["loss", "hinge"], out)
    expect_rejection(checks, "--model not given", train(drop=("--model",)), ["model"], out)

    # --- DDP options: unknown values and contradictions ----------------------
    expect_rejection(checks, "unknown --comm-hook", train(extra=["--comm-hook", "nope"]),
                     ["comm-hook", "nope"], out)
    expect_rejection(checks, "--comm-hook powersgd with rank 0",
                     train(extra=["--comm-hook", "powersgd:0"]), ["powersgd:0"], out)
    expect_rejection(checks, "--comm-hook powersgd starting before the rebuild",
                     train(extra=["--comm-hook", "powersgd:1:1"]), ["powersgd:1:1"], out)
    expect_rejection(checks, "--comm-hook with --predivide-factor",
                     train(extra=["--comm-hook", "fp16", "--predivide-factor", "2"]),
                     ["hook", "predivide"], out)
    expect_rejection(checks, "--message-size with --bucket-cap-mb",
                     train(extra=["--message-size", "10", "--bucket-cap-mb", "1"]),
                     ["message-size", "bucket-cap-mb"], out)
    expect_rejection(checks, "--delay-allreduce with trigger parameters",
                     train(extra=["--delay-allreduce", "--allreduce-trigger-params", "x"]),
                     ["delay_allreduce", "trigger"], out)
    expect_rejection(checks, "--grad-accum 0", train(extra=["--grad-accum", "0"]),
                     ["grad-accum"], out)
    expect_rejection(checks, "--zero-overlap without --zero",
                     train(extra=["--zero-overlap", "step"]), ["zero-overlap"], out)
    expect_rejection(checks, "--zero-overlap of an unknown kind",
                     train(extra=["--zero", "--zero-overlap", "sometimes"]),
                     ["zero-overlap", "sometimes"], out)
    expect_rejection(checks, "--zero-overlap with --comm-hook",
                     train(extra=["--zero", "--zero-overlap", "step", "--comm-hook", "fp16"]),
                     ["comm-hook"], out)
    expect_rejection(checks, "--zero-shard-buckets without --zero-overlap",
                     train(extra=["--zero", "--zero-shard-buckets"]), ["zero-shard-buckets"], out)
    expect_rejection(checks, "--ignore an unknown name",
                     train(extra=["--ignore", "no.such.param"]), ["no.such.param"], out)
    expect_rejection(checks, "--allreduce-trigger-params an unknown name",
                     train(extra=["--allreduce-trigger-params", "nope.weight"]),
                     ["nope.weight"], out)

    # --- SlowMo: --algorithm and fairscale's arguments --------------
    expect_rejection(checks, "unknown --algorithm", train(extra=["--algorithm", "gossip"]),
                     ["algorithm", "gossip"], out)
    expect_rejection(checks, "--slowmo-frequency with --algorithm ddp",
                     train(extra=["--slowmo-frequency", "4"]), ["--slowmo-frequency"], out,
                     also=["ddp"])
    expect_rejection(checks, "--slowmo-momentum with plain localsgd",
                     train(extra=["--algorithm", "localsgd", "--slowmo-momentum", "0.2"]),
                     ["--slowmo-momentum"], out, also=["localsgd"])
    expect_rejection(checks, "--sgp-graph with slowmo-localsgd",
                     train(extra=["--algorithm", "slowmo-localsgd", "--sgp-graph", "ring"]),
                     ["--sgp-graph"], out)
    expect_rejection(checks, "unknown --sgp-graph",
                     train(extra=["--algorithm", "slowmo-sgp", "--sgp-graph", "star"]),
                     ["star"], out)
    expect_rejection(checks, "--slowmo-momentum 1",
                     train(extra=["--algorithm", "slowmo-localsgd", "--slowmo-momentum", "1"]),
                     ["slowmo_momentum", "slowmo-momentum"], out)
    expect_rejection(checks, "--localsgd-frequency 0",
                     train(extra=["--algorithm", "localsgd", "--localsgd-frequency", "0"]),
                     ["localsgd-frequency"], out)
    expect_rejection(checks, "--slowmo-num-shards 0",
                     train(extra=["--algorithm", "slowmo-localsgd", "--slowmo-num-shards", "0"]),
                     ["slowmo-num-shards"], out)
    expect_rejection(checks, "--nprocs-per-node 0",
                     train(extra=["--algorithm", "localsgd", "--nprocs-per-node", "0"]),
                     ["nprocs_per_node", "nprocs-per-node"], out)
    expect_rejection(checks, "--comm-hook with SlowMo",
                     train(extra=["--algorithm", "slowmo-sgp", "--comm-hook", "fp16"]),
                     ["--comm-hook"], out)

    expect_rejection(checks, "--sync-bn with a TorchScript model",
                     train(extra=["--sync-bn"]), ["--sync-bn"], out,
                     also=["TorchScript", cnn_model])

    device_cases(checks, train, out, tmp)

    # --- rejection through concord-run (2 workers) ---------------------------
    launch = [run_bin, "--standalone", "--nproc", "2", "--job-id", "cli-bad", "--"]
    expect_rejection(checks, "concord-run --nproc 2: missing --model file",
                     launch + train(model=nowhere), [nowhere], out, one_line=False)
    expect_rejection(checks, "concord-run --nproc 2: inputs/targets length mismatch",
                     launch + train(data=bad["data_len_mismatch"]),
                     [bad["data_len_mismatch"]], out, one_line=False)

    nowhere_dir = os.path.join(tmp, "no-such-dir")
    expect_rejection(checks, "concord-run --history: a directory that is not there",
                     [run_bin, "--standalone", "--nproc", "1", "--history", nowhere_dir, "--",
                      train_bin], [nowhere_dir], out)
    # A worker whose history file cannot be opened stops before joining.
    expect_rejection(checks, "CONCORD_HISTORY_FILE that cannot be written",
                     ["env", "CONCORD_HISTORY_FILE=" + os.path.join(nowhere_dir, "h")] +
                     train(), ["history file"], out, one_line=False)

    # --- success, world size 1 through concord-run ------------------------
    n_samples, bs, epochs = 40, 8, 2
    steps_expected = epochs * ((n_samples + bs - 1) // bs)
    initial = fixtures.initial_state(cnn_model)
    for label, extra in (("", []), (" --shuffle --seed 3", ["--shuffle", "--seed", "3"])):
        name = "concord-run --nproc 1 trains%s" % label
        out_ok = os.path.join(tmp, "ok%d" % len(extra), "final.pt")
        metrics = os.path.join(tmp, "ok%d" % len(extra), "metrics.json")
        os.makedirs(os.path.dirname(out_ok), exist_ok=True)
        cmd = [run_bin, "--standalone", "--nproc", "1", "--job-id", "cli-ok", "--", train_bin,
               "--model", cnn_model, "--data", cnn_data, "--loss", "cross_entropy",
               "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
               "--weight-decay", "1e-4", "--batch-size", str(bs), "--epochs", str(epochs),
               "--log-interval", "2", "--output", out_ok, "--metrics-out", metrics] + extra
        r = processes.run_command(cmd, timeout=120)
        if not checks.check(r.returncode == 0 and not r.timed_out, name, r.describe()):
            continue
        if not checks.check(os.path.isfile(out_ok), name + ": --output written", r.describe()):
            continue
        try:
            final = fixtures.load_state(out_ok)
        except Exception as e:  # noqa: BLE001
            checks.fail(name + ": torch.load reads --output", "%s: %s" % (type(e).__name__, e))
            continue
        problems = []
        if set(final) != set(initial):
            problems.append("keys %s, expected %s" % (sorted(final), sorted(initial)))
        for k in sorted(set(final) & set(initial)):
            if final[k].dtype != initial[k].dtype or final[k].shape != initial[k].shape:
                problems.append("%s: %s%s, expected %s%s" % (k, final[k].dtype, tuple(final[k].shape),
                                                             initial[k].dtype, tuple(initial[k].shape)))
        checks.check(not problems, name + ": --output has the state_dict keys, dtypes, shapes",
                     "; ".join(problems))
        changed = [k for k in fixtures.parameter_names(cnn_model)
                   if k in final and final[k].shape == initial[k].shape
                   and not torch.equal(final[k], initial[k])]
        checks.check(len(changed) == len(fixtures.parameter_names(cnn_model)),
                     name + ": every parameter changed",
                     "changed only %s" % changed)
        nbt = {k: int(v) for k, v in final.items() if k.endswith("num_batches_tracked")}
        checks.check(all(v == steps_expected for v in nbt.values()),
                     name + ": num_batches_tracked == %d" % steps_expected, str(nbt))
        if not checks.check(os.path.isfile(metrics), name + ": --metrics-out written"):
            continue
        try:
            with open(metrics) as f:
                m = json.load(f)
        except ValueError as e:
            checks.fail(name + ": metrics are JSON", str(e))
            continue
        problems = []
        for key in ("world_size", "steps", "step_time_ms_mean", "step_time_ms_median",
                    "samples_per_second", "final_loss"):
            if key not in m:
                problems.append("no %r" % key)
            elif not isinstance(m[key], (int, float)) or isinstance(m[key], bool) \
                    or not math.isfinite(m[key]):
                problems.append("%r is %r, not a finite number" % (key, m[key]))
        if not problems:
            if m["world_size"] != 1:
                problems.append("world_size %r, expected 1" % m["world_size"])
            if m["steps"] != steps_expected:
                problems.append("steps %r, expected %d" % (m["steps"], steps_expected))
            if not (m["step_time_ms_mean"] > 0 and m["step_time_ms_median"] > 0):
                problems.append("step times not positive")
            if not m["samples_per_second"] > 0:
                problems.append("samples_per_second not positive")
            if not m["final_loss"] >= 0:
                problems.append("final_loss %r is negative" % m["final_loss"])
            # Each committed step and its time, in order: a fresh run's are
            # steps 1 ... N.
            times = m.get("step_times_ms")
            want = list(range(1, m["optimizer_steps"] + 1))
            pairs = times if isinstance(times, list) else []
            if not all(isinstance(t, list) and len(t) == 2 for t in pairs) or \
                    [t[0] for t in pairs] != want or \
                    not all(isinstance(ms, (int, float)) and ms > 0 for _, ms in pairs):
                problems.append("step_times_ms %r is not [[1, ms], ..., [%d, ms]] with ms > 0"
                                % (times, m["optimizer_steps"]))
        checks.check(not problems, name + ": metrics have the documented fields",
                     "; ".join(problems) + " in " + json.dumps(m))


def main():
    args = parse_args()
    checks = Checks()
    tmp = tempfile.mkdtemp(prefix="concord_cli_")
    try:
        run(args, checks, tmp)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failure
        import traceback
        traceback.print_exc()
        checks.fail("test ran to completion", "%s: %s" % (type(e).__name__, e))
    finally:
        if args.keep:
            print("kept %s" % tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())
