"""hydra/launcher=gpus, the assignment logic alone (hydra_plugins/lowbit_gpu_launcher/assign.py): which GPUs a sweep
gets from CUDA_VISIBLE_DEVICES, a device count or hydra.launcher.gpus, and jobs queued onto them one per GPU,
simulated over many random job lengths and outcomes."""

from __future__ import annotations

import heapq
import random

import pytest

# The module, not its names: Hydra's plugin scan (any in-process Hydra start in the same session) executes plugin
# modules again in place, so a class imported by name here would no longer be the one the functions raise.
from hydra_plugins.lowbit_gpu_launcher import assign

U0, U1, U2 = ("GPU-8f3e0b6c-0000-1111-2222-333344445555", "GPU-1c2d3e4f-aaaa-bbbb-cccc-ddddeeeeffff",
              "GPU-00000000-9999-8888-7777-666655554444")


def test_cuda_visible_devices_read_as_cuda_reads_it():
    assert assign.parse_visible("0,1,2") == ("0", "1", "2")
    assert assign.parse_visible(" 3, 1 ") == ("3", "1")
    assert assign.parse_visible(f"{U0},{U1}") == (U0, U1)
    assert assign.parse_visible("MIG-a1b2c3,MIG-d4e5f6") == ("MIG-a1b2c3", "MIG-d4e5f6")
    assert assign.parse_visible("") == () and assign.parse_visible("-1") == ()  # no GPU: the way to hide every GPU
    assert assign.parse_visible("0,-1,2") == ("0",)  # the list ends at the first invalid entry
    assert assign.parse_visible(f"1,{U0}") == ("1",) and assign.parse_visible(f"{U0},1") == (U0,)  # one kind per list
    assert assign.parse_visible("0,1,0") == ()  # a repeated entry: CUDA sees nothing
    assert assign.parse_visible("01,2") == ("1", "2")  # an index is a number


def test_default_is_every_visible_gpu():
    assert assign.launcher_gpus(None, None, 4) == ("0", "1", "2", "3")
    assert assign.launcher_gpus(None, "2,3", 2) == ("2", "3")  # physical indices as the shell wrote them
    assert assign.launcher_gpus(None, f"{U0},{U1},{U2}", 3) == (U0, U1, U2)  # UUIDs given on to the jobs as they are
    # CUDA_VISIBLE_DEVICES may list more than the host has: torch's count says how many are real
    assert assign.launcher_gpus(None, "0,1,2,3", 2) == ("0", "1")


def test_configured_gpus_are_checked():
    assert assign.launcher_gpus(["1", 3], None, 0) == ("1", "3")  # Hydra may give ints
    assert assign.launcher_gpus([U1], f"{U0},{U1}", 2) == (U1,)
    with pytest.raises(assign.GpuListError, match=r"lists 1 twice"):
        assign.launcher_gpus(["1", "01"], None, 0)
    with pytest.raises(assign.GpuListError, match=r"hydra\.launcher\.gpus\[1\]='cuda:1'.*physical index"):
        assign.launcher_gpus(["0", "cuda:1"], None, 0)
    with pytest.raises(assign.GpuListError, match=r"0 is not one of CUDA_VISIBLE_DEVICES='2,3'"):
        assign.launcher_gpus(["0"], "2,3", 2)  # never a GPU the shell hid


@pytest.mark.parametrize("configured, visible, count", [(None, None, 0), (None, "", 8), (None, "-1", 8), ([], None, 8)])
def test_no_gpu_is_a_clear_error_not_a_cpu_fallback(configured, visible, count):
    with pytest.raises(assign.GpuListError, match=r"no GPU to run on .*hydra\.launcher\.gpus=\[0,1\].*hydra/launcher=local"):
        assign.launcher_gpus(configured, visible, count)


def test_a_job_asking_for_another_gpu_than_its_own_is_refused():
    for device in (None, "cpu", "auto", "cuda", "cuda:0"):
        assign.check_job_device(device, 0)
    with pytest.raises(assign.GpuListError, match=r"job #4: model\.device=cuda:1: .*as cuda:0; use model\.device=cuda"):
        assign.check_job_device("cuda:1", 4)


def simulate(jobs: int, gpus: tuple[str, ...], length, fails) -> list[tuple[int, str, float, float, bool]]:
    """Event simulation of the driver loop: (job, gpu, start, end, failed) for every job, in the order they ended."""
    queue = assign.GpuQueue(jobs, gpus)
    clock, ending, out, started = 0.0, [], [], {}
    while not queue.done:
        for job, gpu in queue.assign():
            started[job] = (gpu, clock)
            heapq.heappush(ending, (clock + length(job), job))
        clock, job = heapq.heappop(ending)
        gpu = queue.release(job)
        assert gpu == started[job][0]
        out.append((job, gpu, started[job][1], clock, fails(job)))
    return out


@pytest.mark.parametrize("n_gpus", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_more_jobs_than_gpus_never_share_one_and_all_run(n_gpus, seed):
    rng = random.Random(seed)
    gpus = tuple(f"GPU-{i:04x}" for i in range(n_gpus))
    jobs = rng.randint(1, 3 * n_gpus + 2)
    lengths = [rng.choice([0.5, 1, 2, 7]) for _ in range(jobs)]
    failing = {j for j in range(jobs) if rng.random() < 0.3}  # a failure frees its GPU like a success
    runs = simulate(jobs, gpus, lengths.__getitem__, failing.__contains__)
    assert sorted(r[0] for r in runs) == list(range(jobs))  # every job ran once, failed ones included
    for gpu in gpus:  # no two jobs overlap on one GPU
        spans = sorted((s, e) for _, g, s, e, _ in runs if g == gpu)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # a GPU never idles while a job waits: the sweep takes the greedy list schedule's time
    free = [0.0] * n_gpus
    for j in range(jobs):
        k = free.index(min(free))
        free[k] += lengths[j]
    assert max(r[3] for r in runs) == pytest.approx(max(free))


def test_queue_hands_out_in_order_and_refuses_bad_use():
    queue = assign.GpuQueue(3, ("0", "1"))
    assert queue.assign() == [(0, "0"), (1, "1")]
    assert queue.assign() == []  # both busy
    assert queue.release(1) == "1"
    assert queue.assign() == [(2, "1")] and queue.running == {0: "0", 2: "1"}
    with pytest.raises(KeyError, match="job #1 is not running"):
        queue.release(1)
    queue.release(0), queue.release(2)
    assert queue.done
    with pytest.raises(assign.GpuListError, match="twice"):
        assign.GpuQueue(2, ("0", "0"))
    with pytest.raises(assign.GpuListError, match="at least one GPU"):
        assign.GpuQueue(2, ())
