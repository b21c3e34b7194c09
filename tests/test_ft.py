"""braid.ft: replicas that survive the loss of one of them. Each replica is its own process
(braid.bench.ft_replica), restarted after a SIGKILL as torchrun --max-restarts would. The
checks: at every committed step the live replicas hold bitwise the same parameters and agree on
the members; the killed replica comes back, receives the state and ends equal to the others; the
final model is bitwise the one a single process computes by applying, step by step, the average
of the members' gradients (in member order, as braid's all-reduce sums) with the same optimizer."""

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from braid.bench import ft_replica
from helpers.ranks import listen_ports

DEADLINE_S = 150.0


class Job:
    """Replica processes on one FileStore, restarted when killed (up to ``restarts`` times each)."""

    def __init__(self, tmp_path, replicas: int, steps: int, restarts: int = 3, env: dict = None, **options):
        self.env = dict(os.environ, **(env or {}))
        self.dir = str(tmp_path)
        self.store = os.path.join(self.dir, "store")
        self.replicas, self.steps, self.restarts = replicas, steps, restarts
        self.options = options
        self.procs = {}
        self.starts = {r: 0 for r in range(replicas)}
        self.killed = []  # (replica, time) of every kill seen
        self.stopped = set()  # killed after the job was over: not restarted

    def args(self, replica: int, die: str = "", secret: str = "job-a") -> list:
        args = [
            sys.executable,
            "-m",
            "braid.bench.ft_replica",
            "--replica",
            str(replica),
            "--replicas",
            str(self.replicas),
            "--store",
            self.store,
            "--out",
            self.dir,
            "--steps",
            str(self.steps),
            "--secret",
            secret,
        ]
        if die:
            args += ["--die", die]
        args += ["--die-file", self.die_file(replica), "--hold-file", os.path.join(self.dir, "hold")]
        for k, v in self.options.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        return args

    def die_file(self, replica: int) -> str:
        return os.path.join(self.dir, f"die{replica}")

    def last_record(self) -> dict:
        last = {"step": 0, "members": []}
        for r in range(self.replicas):
            for rec in self.records(r):
                if rec["step"] > last["step"]:
                    last = rec
        return last

    def launch(self, replica: int, die: str = "") -> None:
        self.starts[replica] += 1
        err = open(os.path.join(self.dir, f"stderr{replica}.txt"), "a")
        self.procs[replica] = subprocess.Popen(self.args(replica, die), stdout=err, stderr=err, env=self.env)

    def stderr(self, replica: int) -> str:
        with open(os.path.join(self.dir, f"stderr{replica}.txt")) as f:
            return f.read()[-3000:]

    def run(
        self,
        dies: dict = None,
        restart_dies: dict = None,
        soak_kills: int = 0,
        deadline_s: float = DEADLINE_S,
        orders: list = (),
    ) -> None:
        """Starts every replica (``dies``: replica -> "STEP:PHASE" for its first process,
        ``restart_dies`` for its second) and supervises until all finish. ``orders``: (replica,
        phase) pairs, each given (through the replica's die file) once every replica has
        committed a step together since the last one was carried out. ``soak_kills``: the
        supervisor also SIGKILLs that many random replicas at random moments."""
        dies, restart_dies = dies or {}, restart_dies or {}
        orders, ordered, order_step = list(orders), None, -1
        hold = os.path.join(self.dir, "hold")
        if orders:  # the replicas train on until the last order was carried out and all are back
            open(hold, "w").close()
        for r in range(self.replicas):
            self.launch(r, dies.get(r, ""))
        deadline = time.monotonic() + deadline_s
        rng = random.Random(7)
        soaked = set()  # the processes the soak killed
        next_kill = time.monotonic() + 3.0
        try:
            while True:
                states = {r: p.poll() for r, p in self.procs.items()}
                if all(code is not None and (code == 0 or r in self.stopped) for r, code in states.items()):
                    return
                for r, code in states.items():
                    if code is None or code == 0 or r in self.stopped:
                        continue
                    assert code == -signal.SIGKILL, f"replica {r} exited with {code}:\n{self.stderr(r)}"
                    assert self.starts[r] <= self.restarts, f"replica {r} died {self.starts[r]} times"
                    self.killed.append((r, time.time()))
                    if ordered == r:
                        ordered = None
                    if 0 in states.values():  # the job is over: nothing to rejoin
                        self.stopped.add(r)
                        continue
                    self.launch(r, restart_dies.get(r, "") if self.starts[r] == 1 else "")
                if os.path.exists(hold) and ordered is None and all(code is None for code in states.values()):
                    last = self.last_record()
                    if len(last["members"]) == self.replicas and last["step"] > order_step and not orders:
                        os.unlink(hold)
                    elif len(last["members"]) == self.replicas and last["step"] > order_step:
                        ordered, phase = orders.pop(0)
                        order_step = last["step"]
                        with open(self.die_file(ordered) + ".tmp", "w") as f:
                            f.write(phase)
                        os.replace(self.die_file(ordered) + ".tmp", self.die_file(ordered))
                if soak_kills and time.monotonic() >= next_kill and self._progress() < self.steps - 150:
                    victim = self.procs[rng.randrange(self.replicas)]
                    # A process already killed may not be reaped yet: it is not killed twice.
                    if victim.poll() is None and victim not in soaked:
                        victim.kill()
                        soaked.add(victim)
                        soak_kills -= 1
                    next_kill = time.monotonic() + rng.uniform(0.3, 1.2)
                assert time.monotonic() < deadline, "the job did not finish in time:\n" + "\n".join(
                    f"replica {r}: {self.stderr(r)}" for r in range(self.replicas)
                )
                time.sleep(0.02)
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def _progress(self) -> int:
        steps = [rec["step"] for r in range(self.replicas) for rec in self.records(r)]
        return max(steps, default=0)

    def records(self, replica: int) -> list:
        path = os.path.join(self.dir, f"replica{replica}.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip() and '"step"' in line[:10]]

    def events(self, replica: int) -> list:
        with open(os.path.join(self.dir, f"replica{replica}.jsonl")) as f:
            return [e for line in f if line.startswith('{"events"') for e in json.loads(line)["events"]]

    def final(self, replica: int) -> dict:
        return torch.load(os.path.join(self.dir, f"final{replica}.pt"))


def reference(members_at: dict, steps: int, first_source: int) -> dict:
    """The model a single process gets by applying, at each step, the average of the members'
    gradients summed in member order and divided by their number."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas: the same kernels, the same bits
    try:
        model = ft_replica.make_model(first_source)
        opt = ft_replica.make_optimizer(model)
        for step in range(steps):
            grads = []
            for r in members_at[step]:
                model.zero_grad()
                x, y = ft_replica.batch(step, r)
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                total = grads[0][i].clone()
                for g in grads[1:]:
                    total += g[i]
                p.grad = total / len(grads)
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def check_job(job: Job) -> dict:
    """Every committed step: one digest and one member list on every replica that logged it, each
    step committed once per replica incarnation; finals equal each other and the reference."""
    by_step = {}
    for r in range(job.replicas):
        for rec in job.records(r):
            by_step.setdefault(rec["step"], []).append((r, rec))
    last = max(by_step)
    assert last >= job.steps and sorted(by_step) == list(range(1, last + 1)), sorted(by_step)
    members_at = {}
    for step, recs in by_step.items():
        assert len({rec["digest"] for _, rec in recs}) == 1, (step, recs)
        assert len({tuple(rec["members"]) for _, rec in recs}) == 1, (step, recs)
        members_at[step - 1] = recs[0][1]["members"]
        assert sorted(r for r, _ in recs) == sorted(recs[0][1]["members"]), (step, recs)
    want = reference(members_at, last, first_source=min(members_at[0]))
    finished = [r for r in range(job.replicas) if r not in job.stopped]
    assert finished, "no replica finished"
    for r in finished:
        got = job.final(r)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (r, name)
    return members_at


@pytest.mark.slow
def test_killed_replicas_are_dropped_and_rejoin_bitwise_equal(tmp_path):
    """Kills in every phase of a step, one after the other (each once every replica is back):
    replica 1 inside its gradient all-reduce, then again while loading the state it was sent on
    rejoining; replica 2 after its backward, before the vote; replica 0, the source of every
    recovery so far, inside its all-reduce. Each time the survivors discard the step in flight
    alike, go on without the victim, take it back at a later step boundary, and it ends bitwise
    equal to the others and to the reference. With BRAID_TRACE_DIR the flight recorder's dumps
    name the failure, and braid.ft's event log beside them the reconfigurations."""
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    job = Job(tmp_path, replicas=3, steps=12, step_sleep=0.02, env={"BRAID_TRACE_DIR": str(trace_dir)})
    job.run(orders=[(1, "backward"), (2, "step"), (0, "backward")], restart_dies={1: "0:join"})
    members_at = check_job(job)
    assert [r for r, _ in job.killed] == [1, 1, 2, 0], job.killed
    assert members_at[0] == [0, 1, 2]
    for victim in range(3):  # trained without each victim a while
        assert any(victim not in m for m in members_at.values()), (victim, members_at)
    assert members_at[max(members_at)] == [0, 1, 2], members_at  # and with all again at the end
    epochs = [e for e in job.events(2) if e["kind"] == "epoch"]
    assert epochs[0]["received"], epochs  # replica 2's last process received the state
    # Each failure cost its step in flight only: one discard seen by the survivors per kill.
    discards = [e for e in json_lines(trace_dir / "braid-ft-replica0.jsonl") if e["kind"] == "discard"]
    assert 1 <= len(discards) <= 3, discards
    dumps = [p.read_text() for p in trace_dir.glob("braid-trace-*.json")]
    assert any("PeerError" in d for d in dumps), sorted(p.name for p in trace_dir.iterdir())
    logged = json_lines(trace_dir / "braid-ft-replica0.jsonl")
    assert any(e["kind"] == "epoch" and e["members"] == [0, 2] for e in logged), logged


def json_lines(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_soak_twenty_kills(tmp_path):
    """Twenty SIGKILLs at random moments of a 3-replica job (any phase: backward, vote, quorum,
    state transfer, start-up): no hang, every committed step equal everywhere, the final model
    the reference's."""
    job = Job(tmp_path, replicas=3, steps=1000, restarts=40, step_sleep=0.01)
    job.run(soak_kills=20, deadline_s=240.0)
    check_job(job)
    assert len(job.killed) >= 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replicas_on_a_gpu_drop_a_killed_one_and_take_it_back(tmp_path):
    """Three one-process replicas training a CUDA model (braid's DDP hook carries CUDA buckets,
    the state a joiner receives crosses through the host): replica 1 is killed in its backward,
    the others go on, it rejoins; every committed step's parameters are bitwise equal on every
    replica (GPU kernels are not the CPU reference's, so no reference is compared)."""
    job = Job(tmp_path, replicas=3, steps=10, step_sleep=0.02, device="cuda")
    job.run(orders=[(1, "backward")])
    by_step = {}
    for r in range(job.replicas):
        for rec in job.records(r):
            by_step.setdefault(rec["step"], []).append(rec)
    assert max(by_step) >= job.steps
    for step, recs in by_step.items():
        assert len({rec["digest"] for rec in recs}) == 1, (step, recs)
    assert [r for r, _ in job.killed] == [1], job.killed
    assert any(len(recs[0]["members"]) == 2 for recs in by_step.values())
    finals = [job.final(r) for r in range(job.replicas)]
    for name in finals[0]:
        assert all(torch.equal(f[name], finals[0][name]) for f in finals), name


def kill_one_and_await_its_return(job: Job, hold: str, running) -> None:
    """Supervises a 2-replica job launched elsewhere while ``running()``: once both replicas
    commit a step together, orders replica 1 to die in its backward; once replica 0 has trained
    alone and replica 1 is back, removes ``hold`` so the job can end."""
    deadline = time.monotonic() + DEADLINE_S
    ordered = alone = False
    while running():
        assert time.monotonic() < deadline, [job.stderr(r) for r in range(2)]
        last = job.last_record()
        alone = alone or last["members"] == [0]
        if not ordered and last["members"] == [0, 1]:
            with open(job.die_file(1), "w") as f:
                f.write("backward")
            ordered = True
        elif alone and os.path.exists(hold) and last["members"] == [0, 1]:
            os.unlink(hold)  # replica 1 is back: let the job end
        time.sleep(0.05)


def run_under_torchrun(job: Job, nproc_per_node: int) -> None:
    """Runs each of a 2-replica job's replicas as its own `torchrun --max-restarts 2` job (as many
    workers as the replica has ranks), has replica 1 killed and waits for its return
    (:func:`kill_one_and_await_its_return`); both torchrun jobs must end with 0."""
    hold = os.path.join(job.dir, "hold")
    open(hold, "w").close()
    procs = []
    for r in range(2):
        worker = job.args(r)[1:]  # "-m braid.bench.ft_replica ..." under torchrun
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(nproc_per_node), "--max-restarts", "2", "--monitor-interval", "0.1", *worker]
        err = open(os.path.join(job.dir, f"stderr{r}.txt"), "a")
        procs.append(subprocess.Popen(argv, stdout=err, stderr=err))
    try:
        kill_one_and_await_its_return(job, hold, lambda: any(p.poll() is None for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [job.stderr(r) for r in range(2)]


@pytest.mark.slow
def test_torchrun_restarts_a_killed_replica_which_rejoins(tmp_path):
    """Each replica its own `torchrun --max-restarts 2` (one process): replica 1 is killed in its
    gradient all-reduce, torchrun restarts it with the same arguments, and it rejoins; the job
    ends with every replica bitwise equal to the reference."""
    job = Job(tmp_path, replicas=2, steps=12, step_sleep=0.02)
    run_under_torchrun(job, nproc_per_node=1)
    members_at = check_job(job)
    assert any(m == [0] for m in members_at.values()), members_at  # trained alone while 1 restarted
    starts = [rec for rec in (json.loads(line) for line in open(os.path.join(job.dir, "replica1.jsonl")))
              if "start" in rec]
    assert len(starts) == 2, starts  # torchrun started replica 1 twice


@pytest.mark.slow
def test_torchrun_restarts_a_sharded_replica_whose_rank_was_killed(tmp_path):
    """Each replica its own `torchrun --nproc-per-node 2 --max-restarts 2` whose two workers shard
    the model with braid's ZeRO-3 over the torchrun job's gloo group: one worker of replica 1 is
    killed before the exchange across replicas, torchrun's agent stops its other worker and
    starts both again, and the replica rejoins; every replica ends bitwise equal to the
    reference."""
    job = ShardedJob(tmp_path, replicas=2, steps=8, ranks=2, step_sleep=0.02)
    run_under_torchrun(job, nproc_per_node=2)
    members_at = check_sharded_job(job)
    assert any(m == [0] for m in members_at.values()), members_at
    with open(os.path.join(job.dir, "replica1.jsonl")) as f:
        starts = [rec for rec in map(json.loads, f) if "start" in rec]
    assert len(starts) == 2, starts  # torchrun started replica 1's rank 0 twice


@pytest.fixture
def slurm_cluster(tmp_path):
    """A one-node SLURM cluster under ``tmp_path``: munged with a key and socket of its own,
    slurmctld and slurmd in the foreground on ports of their own; yields the environment that
    points sbatch at it, and stops all three at the end. Skips where SLURM is not installed
    (``make slurm-check`` installs it) or not root (slurmd starts the tasks as their user)."""
    if not all(shutil.which(b) for b in ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")):
        pytest.skip("SLURM is not installed here (make slurm-check installs it and runs this test)")
    if os.geteuid() != 0:
        pytest.skip("a one-node SLURM cluster needs root for slurmd")
    base = tmp_path / "slurm"
    munge = base / "munge"
    for d in (base / "state", base / "spool", base / "log"):
        d.mkdir(parents=True)
    munge.mkdir(mode=0o700)
    key = munge / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname()
    ctld_port, node_port = listen_ports(2)
    (base / "slurm.conf").write_text(f"""ClusterName=braidft
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge}/sock
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs=16 State=UNKNOWN
PartitionName=ft Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")
    env = dict(os.environ, SLURM_CONF=str(base / "slurm.conf"))
    log = open(base / "log" / "daemons.txt", "a")
    daemons = [subprocess.Popen(
        ["munged", "--foreground", "--force", "-S", str(munge / "sock"), "--key-file", str(key),
         "--pid-file", str(munge / "pid"), "--log-file", str(munge / "log"),
         "--seed-file", str(munge / "seed")],
        stdout=log, stderr=log)]
    try:
        deadline = time.monotonic() + 30
        while not (munge / "sock").exists():
            said = (base / "log" / "daemons.txt").read_text
            assert time.monotonic() < deadline and daemons[0].poll() is None, said()
            time.sleep(0.05)
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(subprocess.Popen([daemon, "-D"], stdout=log, stderr=log, env=env))
        while True:
            sinfo = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env)
            state = sinfo.stdout
            if state.strip() == "idle":
                break
            assert time.monotonic() < deadline, f"the SLURM node is not idle: {state!r}"
            time.sleep(0.2)
        yield env
    finally:
        for d in reversed(daemons):
            d.terminate()
            try:
                d.wait(timeout=10)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()


@pytest.mark.slow
def test_slurm_restarts_a_sharded_replica_step_which_rejoins(tmp_path, slurm_cluster):
    """Under SLURM, each replica one `srun --ntasks 2 --kill-on-bad-exit` step of a batch job, in
    a retry loop (the recipe of docs/usage/ft.md); its two tasks shard the model with braid's
    ZeRO-3 over a Communicator built from the step's environment (braid.comm.init). One task of
    replica 1 is killed before the exchange across replicas: srun stops the step, the loop starts
    a new one, the replica rejoins, and every replica ends bitwise equal to the reference."""
    job = ShardedJob(tmp_path, replicas=2, steps=8, ranks=2, step_sleep=0.02)
    hold = os.path.join(job.dir, "hold")
    open(hold, "w").close()
    loops = []
    for r in range(2):
        worker = " ".join(shlex.quote(a) for a in job.args(r))
        out = shlex.quote(os.path.join(job.dir, f"stderr{r}.txt"))
        loops.append(f"""(for attempt in 1 2 3; do
  srun --overlap --ntasks 2 --kill-on-bad-exit=1 --open-mode=append --output {out} {worker} && exit 0
done; exit 1) &""")
    script = os.path.join(job.dir, "job.sh")
    with open(script, "w") as f:
        f.write("#!/bin/bash\n" + "\n".join(loops) + "\nfail=0\n"
                "for p in $(jobs -p); do wait $p || fail=1; done\nexit $fail\n")
    argv = ["sbatch", "--wait", "--ntasks", "4", "--output", os.path.join(job.dir, "batch.txt"), script]
    batch = subprocess.Popen(argv, env=slurm_cluster, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        kill_one_and_await_its_return(job, hold, lambda: batch.poll() is None)
    finally:
        if batch.poll() is None:
            subprocess.run(["scancel", "--user", "root"], env=slurm_cluster)
            batch.kill()
    assert batch.returncode == 0, (batch.stdout.read(), [job.stderr(r) for r in range(2)])
    members_at = check_sharded_job(job)
    assert any(m == [0] for m in members_at.values()), members_at
    with open(os.path.join(job.dir, "replica1.jsonl")) as f:
        starts = [rec for rec in map(json.loads, f) if "start" in rec]
    assert len(starts) == 2, starts  # the loop ran replica 1's step twice


@pytest.mark.slow
def test_a_process_of_another_job_is_refused(tmp_path):
    """A process with another secret on the job's store and prefix is refused at once with an
    error naming the secret; the job is not disturbed."""
    job = Job(tmp_path, replicas=2, steps=30, step_sleep=0.05)
    hold = os.path.join(job.dir, "hold")
    open(hold, "w").close()  # the job trains on until the stranger was turned away
    job.launch(0)
    job.launch(1)
    deadline = time.monotonic() + DEADLINE_S
    while job.last_record()["step"] == 0:  # the job's secret is in the store once it trains
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs.values()), [
            job.stderr(r) for r in range(2)
        ]
        time.sleep(0.05)
    try:
        stranger = subprocess.run(job.args(1, secret="job-b"), capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(hold)
    assert stranger.returncode != 0 and "refused to join" in stranger.stderr, stranger.stderr[-2000:]
    for p in job.procs.values():
        assert p.wait(timeout=DEADLINE_S) == 0
    check_job(job)


class _ReplicaProcesses:
    """The processes of one replica, seen as one: it runs while all run; when one ended badly the
    others are killed at once (as torchrun's agent does with a host's workers) and the replica's
    code is SIGKILL's when one was killed, else the first bad code."""

    def __init__(self, procs: list):
        self.procs = procs

    def poll(self):
        codes = [p.poll() for p in self.procs]
        if all(c == 0 for c in codes):
            return 0
        bad = [c for c in codes if c not in (None, 0)]
        if not bad:
            return None
        self.kill()
        return -signal.SIGKILL if -signal.SIGKILL in bad else bad[0]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def wait(self, timeout=None):
        return max((p.wait(timeout=timeout) for p in self.procs), key=abs)


class ShardedJob(Job):
    """Replicas of ``ranks`` processes each, sharding the model with braid's ZeRO wrapper over a
    braid Communicator of their own; a replica restarts as a whole (every rank, a new replica
    store) when one of its processes dies. ``--die`` goes to the replica's last rank."""

    def __init__(self, tmp_path, replicas: int, steps: int, ranks: int = 2, **kwargs):
        super().__init__(tmp_path, replicas, steps, ranks_per_replica=ranks, **kwargs)
        self.ranks = ranks

    def launch(self, replica: int, die: str = "") -> None:
        self.starts[replica] += 1
        store = os.path.join(self.dir, f"replica{replica}-store{self.starts[replica]}")
        procs = []
        for rank in range(self.ranks):
            err = open(os.path.join(self.dir, f"stderr{replica}.txt"), "a")
            argv = self.args(replica, die if rank == self.ranks - 1 else "")
            argv += ["--local-rank", str(rank), "--replica-store", store]
            procs.append(subprocess.Popen(argv, stdout=err, stderr=err, env=self.env))
        self.procs[replica] = _ReplicaProcesses(procs)

    def records(self, replica: int) -> list:
        out = []
        for rank in range(self.ranks):
            name = f"replica{replica}" + (f".rank{rank}" if rank else "")
            path = os.path.join(self.dir, f"{name}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    out += [json.loads(line) for line in f if line.strip() and '"step"' in line[:10]]
        return out


def sharded_reference(members_at: dict, steps: int, first_source: int, ranks: int) -> dict:
    """The model a single process gets by averaging, at each step, each member's ranks' gradients
    (the wrapper's reduce-scatter inside the replica), then the members' averages summed in member
    order and divided by their number, and stepping the optimizer on the whole model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ft_replica.make_model(first_source)
        opt = ft_replica.make_optimizer(model)
        for step in range(steps):
            averages = []
            for r in members_at[step]:
                per_rank = []
                for rank in range(ranks):
                    model.zero_grad()
                    x, y = ft_replica.batch(step, r, rank)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    per_rank.append([p.grad.clone() for p in model.parameters()])
                count = len(per_rank[0])
                averages.append([_in_order([g[i] for g in per_rank]) / ranks for i in range(count)])
            for i, p in enumerate(model.parameters()):
                p.grad = _in_order([a[i] for a in averages]) / len(averages)
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _in_order(tensors: list) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def check_sharded_job(job: ShardedJob) -> dict:
    """Every committed step: each rank's shards bitwise the same on every replica that logged the
    step (one digest per step and rank), one member list; the finals (each replica's full state)
    equal each other and the reference."""
    by_step = {}
    for r in range(job.replicas):
        for rec in job.records(r):
            by_step.setdefault(rec["step"], []).append((r, rec))
    last = max(by_step)
    assert last >= job.steps and sorted(by_step) == list(range(1, last + 1)), sorted(by_step)
    members_at = {}
    for step, recs in by_step.items():
        for rank in range(job.ranks):
            digests = {rec["digest"] for _, rec in recs if rec["rank"] == rank}
            assert len(digests) == 1, (step, rank, recs)
        assert len({tuple(rec["members"]) for _, rec in recs}) == 1, (step, recs)
        members_at[step - 1] = recs[0][1]["members"]
        want = sorted((m, rank) for m in members_at[step - 1] for rank in range(job.ranks))
        assert sorted((r, rec["rank"]) for r, rec in recs) == want, (step, recs)
    want = sharded_reference(members_at, last, min(members_at[0]), job.ranks)
    finished = [r for r in range(job.replicas) if r not in job.stopped]
    assert finished, "no replica finished"
    for r in finished:
        got = job.final(r)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (r, name, (got[name] - tensor).abs().max())
    return members_at


@pytest.mark.slow
@pytest.mark.parametrize("inner", ("zero", "fsdp2"))
def test_sharded_replicas_drop_a_replica_that_lost_a_rank_and_take_it_back(tmp_path, inner):
    """Replicas of two ranks sharding the model (braid's ZeRO-3 over their own communicator, or
    FSDP2's fully_shard over a gloo group of theirs, its state received through
    ``ft.load_local_shards``):
    replica 1's second rank is killed just before the gradient exchange across replicas, its
    other rank is killed with it (as torchrun's agent would), both restart, and the new rank 1
    dies again while loading the state sent to it; later replica 2's rank dies before the vote.
    Each time the survivors discard the step in flight alike and go on; the killed replica comes
    back, receives each rank's shards and optimizer state from the same rank of a healthy
    replica, and every replica ends bitwise equal to the reference computed in one process."""
    job = ShardedJob(tmp_path, replicas=3, steps=10, ranks=2, step_sleep=0.02, inner=inner)
    job.run(orders=[(1, "backward"), (2, "step")], restart_dies={1: "0:join"})
    members_at = check_sharded_job(job)
    assert [r for r, _ in job.killed] == [1, 1, 2], job.killed
    assert members_at[0] == [0, 1, 2]
    for victim in (1, 2):
        assert any(victim not in m for m in members_at.values()), (victim, members_at)
    assert members_at[max(members_at)] == [0, 1, 2], members_at


def test_bad_arguments_are_named(tmp_path):
    from braid import ft
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "s"), -1)
    ok = dict(replica_id=0, num_replicas=1, store=store)
    with pytest.raises(TypeError, match="state_dict and load_state_dict must be callables"):
        ft.Manager({}, lambda s: None, **ok)
    with pytest.raises(ValueError, match="replica_id must be an int"):
        ft.Manager(dict, lambda s: None, **dict(ok, replica_id=-1))
    with pytest.raises(ValueError, match="num_replicas must be an int"):
        ft.Manager(dict, lambda s: None, **dict(ok, num_replicas=0))
    with pytest.raises(ValueError, match="min_replicas must be an int"):
        ft.Manager(dict, lambda s: None, min_replicas=0, **ok)
    with pytest.raises(ValueError, match="dead_after_s"):
        ft.Manager(dict, lambda s: None, dead_after_s=0.2, heartbeat_s=0.1, **ok)
    with pytest.raises(ValueError, match="BRAID_FT_STORE"):
        ft.Manager(dict, lambda s: None, replica_id=0, num_replicas=1)
    with pytest.raises(TypeError, match="replica_group must be"):
        ft.Manager(dict, lambda s: None, replica_group="host0", **ok)


class _TwoRanks:
    """A stand-in replica group of two ranks (never used for a collective: refused before)."""

    rank, world_size = 0, 2

    def _never(self, *args, **kwargs):
        raise AssertionError("no collective expected")

    all_reduce = all_gather = reduce_scatter = broadcast = _never


def test_a_replica_of_another_shape_is_refused(tmp_path):
    """Every replica of a job has the same number of ranks (rank i of each meets the others' in
    lane i): a replica of two ranks on a job of one-rank replicas is refused, naming both."""
    from braid import ft
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "s"), -1)
    first = ft.Manager(dict, lambda s: None, replica_id=0, num_replicas=2, store=store)
    try:
        with pytest.raises(ft.FTError, match=r"this replica has 2 rank\(s\).*the job's replicas have 1"):
            ft.Manager(dict, lambda s: None, replica_id=1, num_replicas=2, store=store,
                       replica_group=_TwoRanks())
    finally:
        first.shutdown()


@pytest.mark.timeout(60)  # the readline below waits for the server's first line
@pytest.mark.slow
def test_the_store_server_serves_until_terminated():
    """`python -m braid.ft store --port 0` prints the port it listens on, serves a TCPStore there
    and exits 0 on SIGTERM."""
    import torch.distributed as dist

    argv = [sys.executable, "-m", "braid.ft", "store", "--port", "0", "--host", "127.0.0.1"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("braid.ft store listening on 127.0.0.1:"), line
        client = dist.TCPStore("127.0.0.1", int(line.rsplit(":", 1)[1]), is_master=False)
        client.set("k", "v")
        assert client.get("k") == b"v"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_slurm_steps_derive_stores_of_their_own(monkeypatch):
    """braid.comm.init under srun: every task of a step derives the same store address (the
    step's first host), step 0 the job's port as before, and other steps of the job (replicas
    side by side, a restarted step) ports of their own."""
    from braid.comm.core import launch_env

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[07-09],gpu1")
    assert launch_env.master_addr() == "node07"
    ports = []
    for step in ("0", "1", "2", "3"):
        monkeypatch.setenv("SLURM_STEP_ID", step)
        ports.append(launch_env.master_port())
    assert ports[0] == 20000 + 4242
    assert len(set(ports)) == 4 and all(20000 <= p < 40000 for p in ports), ports
    monkeypatch.delenv("SLURM_STEP_ID")
    assert launch_env.master_port() == ports[0]  # the batch script itself: the job's port
