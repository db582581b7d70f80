"""The solver: optimal against brute force for each target kind, constraints kept, infeasible targets refused
naming the recipe key, the frontier non-dominated, 300 layers x 10 candidates well under a second; and a tiny
Krea 2 run per target wiring it through the quantize stage (speed table cached under tmp_path)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch

import lowbit_pipe
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.plan.solver import LayerCosts, Problem, frontier, predict, solve
from lowbit_pipe.plan.targets import Target
from lowbit_pipe.quant.nn import QuantLinear


def _problem(layers: int, options: int, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(layers):
        n = int(rng.integers(2, options + 1))
        out.append(LayerCosts(f"l{i}", tuple(f"c{j}" for j in range(n)), tuple(rng.uniform(0.1, 2.0, n)),
                              tuple(int(b) for b in rng.integers(100, 1000, n)), tuple(rng.uniform(0, 0.01, n))))
    return Problem(out, fixed_ms=1.0, fixed_bytes=500, float_ms=12.0, float_bytes=8000, error_scale=0.5)


def _brute(problem: Problem, target: Target):
    """The best plan by enumeration: least error meeting a time/bytes bound, least time meeting an error bound."""
    best = None
    for choice in itertools.product(*(range(len(layer.labels)) for layer in problem.layers)):
        p = predict(problem, choice)
        ok = {"speedup": p.speedup >= target.value, "bytes": p.nbytes <= target.value,
              "ratio": p.ratio <= target.value, "error": p.error <= target.value}[target.kind]
        if ok:
            key = p.time_ms if target.kind == "error" else p.error
            if best is None or key < best:
                best = key
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["speedup", "bytes", "ratio", "error"])
def test_solver_meets_the_target_close_to_the_brute_force_optimum(kind, seed):
    problem = _problem(6, 3, seed)
    m = {"speedup": (problem.float_ms / sum(max(lay.time_ms) for lay in problem.layers),
                     problem.float_ms / (problem.fixed_ms + sum(min(lay.time_ms) for lay in problem.layers)))}
    value = {"speedup": sum(m["speedup"]) / 2,
             "bytes": problem.fixed_bytes + sum(np.mean(lay.nbytes) for lay in problem.layers),
             "ratio": (problem.fixed_bytes + sum(np.mean(lay.nbytes) for lay in problem.layers)) / problem.float_bytes,
             "error": problem.error_scale * math.sqrt(sum(np.mean(lay.err2) for lay in problem.layers))}[kind]
    target = Target(kind, float(value), f"quantize.target.{kind}")
    best = _brute(problem, target)
    sol = solve(problem, target)
    assert sol.met
    got = sol.prediction.time_ms if kind == "error" else sol.prediction.error
    # Lagrangian + greedy fill is not exact for a knapsack; on these it lands within 10 % of the optimum
    # (an all-cheapest plan is typically 2-5x off).
    assert got <= best * 1.10 + 1e-12, (got, best)


def test_infeasible_target_names_the_key_and_the_reachable_value():
    problem = _problem(5, 3, 0)
    with pytest.raises(RecipeError, match=r"quantize.target.speedup.*cannot be met.*predicted at \d"):
        solve(problem, Target("speedup", 100.0, "quantize.target.speedup"))
    with pytest.raises(RecipeError, match=r"quantize.target.bytes"):
        solve(problem, Target("bytes", 10.0, "quantize.target.bytes"))


def test_output_error_adds_in_quadrature_and_bounds_an_error_target():
    """An error measured on the output (the attention format's) adds to the scaled layer sum in quadrature; an
    error target below it alone is refused, one above it is met counting it."""
    from dataclasses import replace

    problem = _problem(6, 3, 2)
    with_att = replace(problem, output_err2=0.004 ** 2)
    choice = (0,) * len(problem.layers)
    plain, added = predict(problem, choice), predict(with_att, choice)
    assert added.error == pytest.approx(math.hypot(plain.error, 0.004))
    assert added.time_ms == plain.time_ms and added.nbytes == plain.nbytes
    with pytest.raises(RecipeError, match=r"quantize.target.error.*predicted at 0.004"):
        solve(replace(with_att, error_scale=0.0), Target("error", 0.0039, "quantize.target.error"))
    bound = math.hypot(0.004, problem.error_scale * math.sqrt(sum(np.mean(lay.err2) for lay in problem.layers)))
    sol = solve(with_att, Target("error", bound, "quantize.target.error"))
    assert sol.met and sol.prediction.error <= bound * (1 + 1e-9)
    assert sol.prediction.error == pytest.approx(predict(with_att, sol.choice).error)


def test_solving_per_attention_format_takes_the_best_met_plan():
    """A faster attention with some error: a speed target only it can meet picks it; a byte target (both meet it)
    picks the format with less error; one neither meets names the closest format and what it reaches."""
    from dataclasses import replace

    from lowbit_pipe.plan.target_plan import solve_per_attention

    problem = _problem(8, 3, 4)
    fastest = problem.fixed_ms + sum(min(lay.time_ms) for lay in problem.layers)
    problems = {"bf16": problem, "fp8": replace(problem, fixed_ms=problem.fixed_ms - 0.5, output_err2=1e-6)}
    speed = Target("speedup", problem.float_ms / (fastest - 0.25), "quantize.target.speedup")
    fmt, sol, solved = solve_per_attention(problems, speed)
    assert fmt == "fp8" and sol.met and "bf16" not in solved
    ratio = Target("ratio", 1.0, "quantize.target.ratio")
    fmt, sol, solved = solve_per_attention(problems, ratio)
    assert fmt == "bf16" and solved["fp8"].met and sol.prediction.error < solved["fp8"].prediction.error
    with pytest.raises(RecipeError, match=r"quantize.target.speedup.*predicted at [\d.]+x \(attention fp8, the "
                                          r"closest of \['bf16', 'fp8'\]\)"):
        solve_per_attention(problems, Target("speedup", 100.0, "quantize.target.speedup"))


def test_frontier_is_non_dominated_and_spans_the_extremes():
    problem = _problem(40, 5, 3)
    front = frontier(problem, 12)
    figs = np.array([[p.prediction.time_ms, p.prediction.nbytes, p.prediction.error] for p in front])
    assert len(front) >= 3
    for i in range(len(figs)):
        assert not (np.all(figs <= figs[i], axis=1) & np.any(figs < figs[i], axis=1)).any()
    fastest = problem.fixed_ms + sum(min(lay.time_ms) for lay in problem.layers)
    assert figs[:, 0].min() == pytest.approx(fastest)
    assert figs[:, 2].min() == pytest.approx(problem.error_scale * math.sqrt(sum(min(lay.err2) for lay in problem.layers)))


def test_solver_time_300_layers_10_candidates_under_a_second():
    problem = _problem(300, 10, 1)
    target = Target("speedup", problem.float_ms / (problem.fixed_ms + sum(np.mean(lay.time_ms) for lay in problem.layers)),
                    "quantize.target.speedup")
    started = time.perf_counter()
    solve(problem, target)
    frontier(problem, 16)
    assert time.perf_counter() - started < 1.0


@pytest.fixture(scope="module")
def speed_cache(tmp_path_factory):
    """One speed table for this file's runs (never the user's ~/.cache): the first run times, the rest reuse."""
    return tmp_path_factory.mktemp("speed_cache")


def _run(tmp_path, overrides, cache=None, name="run"):
    return lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", f"quantize.speed_cache={cache or tmp_path / 'cache'}",
                                       "quantize.calibration_samples=1", "quantize.calibration_steps=1", *overrides],
                           run_dir=tmp_path / name)


def test_ratio_target_with_a_rule_keeps_the_rule_and_fits(tmp_path, speed_cache):
    """A byte target lands under its bytes; a rule's layer keeps the rule's format (a constraint); keep-float
    layers stay float; the real model's size is the prediction's; the forward check reports."""
    r = _run(tmp_path, ["quantize.target.ratio=0.6", "quantize.rules=[{match: '*ff.down', format: int8}]"], speed_cache)
    t = r.report["quantize"]["target"]
    plan = {p["name"]: p for p in r.report["plan"]}
    assert t["met"] and t["predicted"]["ratio"] <= 0.6
    from lowbit_pipe.ledger import tensor_bytes
    assert tensor_bytes(r.model) == t["predicted"]["bytes"]
    downs = [p for n, p in plan.items() if n.endswith("ff.down")]
    assert downs and all(p["format"] == "int8" and p["reason"].startswith("rule 0") for p in downs)
    kept = [p for p in plan.values() if p["reason"].startswith("arch keep-float")]
    assert kept and all(p["format"] is None for p in kept)
    assert t["free_layers"] == sum(p["reason"].startswith("target ratio") for p in plan.values())
    assert set(t["choice"]) == {n for n, p in plan.items() if p["reason"].startswith("target ratio")}
    assert sum(t["layers"].values()) == len(t["choice"])
    fc = t["forward_check"]
    assert fc["off"] == pytest.approx(fc["measured_ms"] / fc["predicted_ms"] - 1, abs=1e-5)
    assert fc["predicted_ms"] == pytest.approx(t["predicted"]["time_ms"], rel=1e-5)
    # The error is deterministic: the prediction (each layer's error times its gain and its candidate's scale, in
    # quadrature) is within 2x.
    assert 0.5 < fc["measured_error"] / fc["predicted_error"] < 2.0
    assert t["frontier"] and r.report["stages"]["quantize"]["target_off"] == pytest.approx(fc["off"], abs=1e-3)
    summary = (r.run_dir / "summary.txt").read_text()
    assert "target: ratio 0.6 (met" in summary and "target check: measured" in summary and "frontier the solver saw" in summary
    assert "weighed on measured figures" in summary and t["selection"]["plans"]["solver"]["met"]
    from lowbit_pipe.report import main as report_main
    assert report_main([str(r.run_dir), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "frontier.png").stat().st_size > 1000


def test_a_uniform_plans_predicted_error_is_its_measured_error(tmp_path, speed_cache):
    """The output error does not grow alike across formats, so one scale probed at the least accurate candidate
    (nvfp4 here) mispredicted an all-int8 plan by 14 % on the tiny Krea 2 (4x for an int8 / fp8 mix on the full-size
    one). Each candidate's own probe makes a uniform plan's prediction its error; every layer has its gain."""
    r = _run(tmp_path, ["quantize.target.ratio=0.6", "quantize.target.allow_float=false",
                        "quantize.target.candidates=[{format: int8}, {format: nvfp4}]"], speed_cache)
    t = r.report["quantize"]["target"]
    assert t["layers"] == {"int8": t["free_layers"]}  # the most accurate candidate fits the bytes everywhere
    model = t["error_model"]
    assert set(model["scales"]) == {"int8", "nvfp4"} and len(model["gains"]) == t["free_layers"]
    assert all(v["layers"] == t["free_layers"] for v in model["scales"].values())
    assert model["probes"] == t["free_layers"] + 2
    fc = t["forward_check"]
    assert fc["measured_error"] == pytest.approx(fc["predicted_error"], rel=0.01)
    assert model["scales"]["int8"]["probe_output_error"] == pytest.approx(fc["measured_error"], rel=0.01)
    gains = sorted(model["gains"].values())
    assert gains[-1] > 3 * gains[0]  # why one gain per layer: the layers move the output very differently


def test_a_static_activation_candidate_is_timed_probed_and_calibrated(tmp_path, speed_cache):
    """A candidate with static activations: the speed table times it (it failed there, asking for an input amax the
    timing has no use for), it has no probe of its own (no calibrated scale yet) and borrows the largest measured
    scale, and the layers that take it get their calibrated input scales."""
    r = _run(tmp_path, ["quantize.target.ratio=0.6", "quantize.target.candidates=[{format: int8, activations: static}, "
                                                      "{format: fp8}]"], speed_cache)
    t = r.report["quantize"]["target"]
    scales = t["error_model"]["scales"]
    assert t["met"] and t["layers"].get("int8 act=static", 0) > 0
    assert "from" in scales["int8 act=static"] and scales["int8 act=static"]["scale"] == scales["fp8"]["scale"]
    assert t["error_model"]["probes"] == t["free_layers"] + 1  # each layer's gain (at fp8), fp8's scale; none static
    static = [m for m in r.model.modules() if isinstance(m, QuantLinear) and "input_scale" in m._buffers]
    assert len(static) == t["layers"]["int8 act=static"] and all(float(m.input_scale) > 0 for m in static)
    fc = t["forward_check"]
    assert 0.5 < fc["measured_error"] / fc["predicted_error"] < 2.0


def test_at_krea2_nvfp4s_bytes_the_solvers_plan_has_less_error_than_krea2_nvfp4(tmp_path, speed_cache):
    """The hand-written recipe against the solver given its bytes and its formats among the candidates, both measured
    by evaluate on inputs the solver never probed (other seeds, Euler trajectories). With error scales per candidate
    but none per layer the solver's plan measured 6.7e-3 against krea2_nvfp4's 5.8e-3; with the per-layer gains, 5.4e-3."""
    from lowbit_pipe.ledger import tensor_bytes

    tokens = ["evaluate.image_tokens=256", "evaluate.text_tokens=64", "evaluate.text_valid=20"]
    hand = lowbit_pipe.run("krea2_nvfp4", tokens + ["pipeline=[load,detect,quantize,evaluate]"], run_dir=tmp_path / "hand")
    hand_bytes, hand_err = tensor_bytes(hand.model), hand.report["evaluate"]["rel_error"]
    lowbit_pipe.teardown(hand)
    float_run = lowbit_pipe.run("default", ["pipeline=[load,detect]", "model=tiny_krea2"], run_dir=tmp_path / "f")
    ratio = hand_bytes / tensor_bytes(float_run.model)
    lowbit_pipe.teardown(float_run)
    auto = lowbit_pipe.run("krea2_auto_speed_tiny", tokens + [
        f"quantize.target.ratio={ratio:.6f}", f"quantize.speed_cache={speed_cache}",
        "quantize.target.loads_in=comfyui_pack", "quantize.target.candidates=[{format: int8}, {format: int8, rotation: "
        "convrot}, {format: fp8}, {format: nvfp4}, {format: nvfp4, rotation: convrot, rotation_group: 256}]"],
        run_dir=tmp_path / "auto")
    assert tensor_bytes(auto.model) <= hand_bytes
    assert auto.report["evaluate"]["rel_error"] < hand_err
    lowbit_pipe.teardown(auto)


def test_uniform_probes_correct_a_speed_table_that_is_off(tmp_path):
    """The table's layer times do not add up to the forward's (on the H100 an int8 / fp8 plan ran 4 % and a W4A4
    plan 6 % faster than predicted). One timed forward per candidate scales its layer times: here a table whose int8
    times are 5x too slow (a stale cache) put the all-int8 plan far off; with the probe it is the measured time."""
    import json

    cache = tmp_path / "cache"
    args = ["quantize.target.ratio=0.6", "quantize.target.allow_float=false", "quantize.target.candidates=[{format: int8}]"]
    _run(tmp_path, args, cache, name="fill")  # times the table
    (path,) = cache.glob("speed_*.json")
    data = json.loads(path.read_text())
    data["times_ms"] = {k: v * (5.0 if k.startswith("int8") else 1.0) for k, v in data["times_ms"].items()}
    path.write_text(json.dumps(data))
    stale = _run(tmp_path, args + ["quantize.target.uniform_probes=false"], cache, name="stale")
    fc = stale.report["quantize"]["target"]["forward_check"]
    assert fc["off"] < -0.4  # predicted 5x too slow for the layers
    lowbit_pipe.teardown(stale)
    r = _run(tmp_path, args, cache, name="probed")
    t = r.report["quantize"]["target"]
    probe = t["speed_model"]["int8"]
    assert probe["layers"] == t["free_layers"] and probe["scale"] < 0.5
    assert t["predicted"]["time_ms"] == pytest.approx(probe["measured_ms"], rel=1e-4)  # uniform: its measured time
    # the same model timed again: CPU timing noise only (0.28 seen with the suite's two workers busy), still apart
    # from the stale table's < -0.4
    assert abs(t["forward_check"]["off"]) < 0.35
    assert t["selection"]["chosen"] == "solver"  # it is the uniform plan
    assert probe["error"] == pytest.approx(t["forward_check"]["measured_error"], rel=1e-3)


def test_a_met_uniform_plan_with_less_measured_error_replaces_the_solvers():
    """The measured figures decide between the solver's plan and the uniform plans (the error model mispredicted
    a mixed int8 / fp8 / float plan at full size, below all-int8 that measured less): the winner meets the
    target; a speedup target takes the least error, an error target the least time."""
    from lowbit_pipe.plan.solver import LayerCosts
    from lowbit_pipe.plan.speed_model import SpeedModel, UniformProbe
    from lowbit_pipe.plan.target_plan import weigh_uniform

    labels = ("a", "b", "float")
    layers = [LayerCosts("l0", labels, (1.0, 0.5, 2.0), (1, 1, 2), (1e-6, 4e-6, 0.0)),
              LayerCosts("l1", ("a", "float"), (1.0, 2.0), (1, 2), (1e-6, 0.0))]
    problem = Problem(layers, fixed_ms=1.0, fixed_bytes=0, float_ms=5.0, float_bytes=4, error_scale=1.0)
    target = Target("speedup", 1.5, "quantize.target.speedup")
    solution = solve(problem, target)
    speed = SpeedModel({"a": UniformProbe("a", ["l0", "l1"], 3.0, 2.0, 1.0, 1e-3),
                        "b": UniformProbe("b", ["l0"], 3.5, 0.5, 1.0, 5e-4)})
    won, sel = weigh_uniform(problem, solution, speed, plan_error=2e-3, target=target)
    assert sel["chosen"] == "a" and won.choice == (0, 0) and won.prediction.error == pytest.approx(1e-3)
    assert sel["plans"]["b"]["met"] is False  # l1 float: 1 + 0.5 + 2 = 3.5 ms, 1.43x
    kept, sel = weigh_uniform(problem, solution, speed, plan_error=5e-4, target=target)
    assert sel["chosen"] == "solver" and kept is solution
    error_target = Target("error", 1.5e-3, "quantize.target.error")
    fast, sel = weigh_uniform(problem, solve(problem, error_target), speed, plan_error=2e-3, target=error_target)
    assert sel["chosen"] == "a" and sel["plans"]["b"]["met"] is True and fast.prediction.time_ms == 3.0


@pytest.mark.slow
def test_error_target_without_float_is_met_by_the_measured_error(tmp_path, speed_cache):
    r = _run(tmp_path, ["quantize.target.error=0.004", "quantize.target.allow_float=false"], speed_cache)
    t = r.report["quantize"]["target"]
    assert t["met"] and "float" not in t["layers"]
    assert t["forward_check"]["measured_error"] < 0.004 * 1.5


def test_attention_formats_are_measured_and_the_chosen_one_is_applied_before_the_check(tmp_path, speed_cache):
    """quantize.target.attention: each format is timed in the forward and its output error measured; the report
    lists both. A byte target picks the stock attention (same bytes, no error); a format the recipe leaves as the
    only choice is applied before the whole-forward check, whose measured error then counts it, and teardown
    gives the stock processors back."""
    from lowbit_pipe.attention.processors import attention_modules

    r = _run(tmp_path, ["quantize.target.ratio=0.6", "quantize.target.attention=[bf16,int8]"], speed_cache, "both")
    att = r.report["quantize"]["target"]["attention"]
    assert att["chosen"] == "bf16" and set(att["options"]) == {"bf16", "int8"}
    int8 = att["options"]["int8"]
    assert 1e-5 < int8["error"] < 0.05 and int8["forward_ms"] > 0 and int8["calls"].get("int8", 0) >= 2
    assert att["options"]["bf16"]["error"] == 0 and int8["met"]
    assert int8["predicted"]["error"] > att["options"]["bf16"]["predicted"]["error"]
    assert r.report["attention"] == {"format": "bf16", "chosen_by": "quantize.target"}
    assert r.report["plan_attention"]["chosen_by"] == "quantize.target"  # the Plan says who chose it, and why
    assert r.report["plan_attention"]["reason"].startswith("quantize.target weighed ['bf16', 'int8']")
    assert {p["attention"] for p in r.report["quantize"]["target"]["frontier"]} <= {"bf16", "int8"}

    r = _run(tmp_path, ["quantize.target.ratio=0.6", "quantize.target.attention=[int8]"], speed_cache, "int8")
    t = r.report["quantize"]["target"]
    assert t["attention"]["chosen"] == "int8"
    assert r.report["attention"]["format"] == "int8" and r.report["attention"]["applied"]
    assert r.report["attention"]["chosen_by"] == "quantize.target"
    assert r.report["plan_attention"] == {"format": "int8", "chosen_by": "quantize.target",
                                          "reason": "quantize.target.attention lists int8 alone"}
    fc = t["forward_check"]
    # the attention's own error is in both the prediction and the measured check
    assert fc["predicted_error"] >= t["attention"]["options"]["int8"]["error"]
    assert 0.5 < fc["measured_error"] / fc["predicted_error"] < 2.0
    model = r.model
    eight = {n for n, m in attention_modules(model).items() if type(m.processor).__name__.endswith("8bit")}
    assert eight == {"transformer_blocks.0.attn", "transformer_blocks.1.attn"}  # the text fusion's: arch_keep
    torn = lowbit_pipe.teardown(r)
    assert torn["errors"] == [] and torn["undone"].get("attention_processor") == 2  # the joint blocks' (arch_keep)
    assert not any(type(m.processor).__name__.endswith("8bit") for m in attention_modules(model).values())


def test_recipe_errors_name_the_key(tmp_path):
    with pytest.raises(RecipeError, match=r"quantize.target.ratio.*set one target, got speedup, ratio"):
        _run(tmp_path, ["quantize.target.ratio=0.5", "quantize.target.speedup=1.2"])
    with pytest.raises(RecipeError, match=r"quantize.budget_ratio.*not both"):
        _run(tmp_path, ["quantize.target.ratio=0.5", "quantize.budget_ratio=0.5"])
    with pytest.raises(RecipeError, match=r"quantize.target.candidates\[1\].*stock ComfyUI"):
        _run(tmp_path, ["quantize.target.ratio=0.5", "quantize.target.loads_in=comfyui",
                        "quantize.target.candidates=[{format: int8}, {format: svdquant_w4a4}]"])
    with pytest.raises(RecipeError, match=r"quantize.target.error.*planned by a run"):
        lowbit_pipe.quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)), {"target": {"error": 0.01}})
    # the byte budget too: lowbit_pipe.quantize once quantized every layer and ignored it without a word
    for key, value in (("budget_ratio", 0.4), ("budget_bytes", 10_000)):
        module = torch.nn.Sequential(torch.nn.Linear(64, 64))
        with pytest.raises(RecipeError, match=rf"quantize.{key}.*planned by a run"):
            lowbit_pipe.quantize(module, {key: value})
        assert type(module[0]) is torch.nn.Linear  # refused before any layer changed
    with pytest.raises(RecipeError, match=r"quantize.target.loads_in"):
        _run(tmp_path, ["quantize.target.ratio=0.5", "quantize.target.loads_in=comfy"])
    with pytest.raises(RecipeError, match=r"quantize.target.attention\[1\].*bf16, int8, fp8.*'int4'"):
        _run(tmp_path, ["quantize.target.ratio=0.5", "quantize.target.attention=[bf16,int4]"])
    with pytest.raises(RecipeError, match=r"quantize.target.attention.*attention.format is 'fp8' already"):
        _run(tmp_path, ["quantize.target.ratio=0.5", "quantize.target.attention=[bf16,int8]", "attention.format=fp8"])
    with pytest.raises(RecipeError, match=r"quantize.target.attention.*set one"):
        _run(tmp_path, ["quantize.target.attention=[int8]"])


def test_a_target_needs_the_model_loaded():
    from lowbit_pipe.plan.stream_choice import stream_blockers
    from lowbit_pipe.recipe import Recipe

    recipe = Recipe()
    assert not any(k == "quantize.target" for k, _ in stream_blockers(recipe))
    recipe.quantize.target.ratio = 0.5
    assert any(k == "quantize.target" and "forwards" in why for k, why in stream_blockers(recipe))
