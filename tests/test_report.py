"""The run report (`rcgrpo_jax.report`): built from a run's files, opened in headless Chromium.

The browser checks (`check_page`) run here on a small hand-written RL arm (every field of the
schema, model text that looks like HTML) and, in tests/test_stages.py, on the shortened stage
`all` run of that file. Chromium is Debian's `chromium` + `chromium-driver`, driven by Selenium,
with no network: under CI=true a missing browser fails the test, elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO

from rcgrpo_jax import report
from rcgrpo_jax.report.read import changed

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# model text that must show as the characters sampled, never as markup
INJECTED = '<img src=x onerror="document.body.dataset.pwned=1"><b>bold</b>'
HIGH_TOKEN = "<|high_reward|>"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_fake_arm(workdir: Path, iterations: int = 3, groups: int = 3, size: int = 4) -> Path:
    """An RL arm's files as a run writes them, with two held-out evaluations: task i fails at
    the start when i % 3 == 0 and passes at the end unless i % 4 == 1."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics, rollouts, groups_out = [], [], []
    metrics.append({"step": 0, "rollouts": 0, "eval_success": 0.5, "eval_sampled": 0.4})
    for it in range(1, iterations + 1):
        rewards = [[float((r + g + it) % 2) for r in range(size)] for g in range(groups)]
        tokens = [["high" if r % 2 else "low" for r in range(size)] for _ in range(groups)]
        metrics.append(
            {
                "step": it,
                "rollouts": it * groups * size,
                "reward_mean": 0.5,
                "reward_high": 0.6,
                "reward_low": 0.3,
                "degenerate_frac": 0.25,
                "entropy": 0.9 / it,
                "kl": 0.0,
                "clip_frac": 0.01,
                "logp_gap_mean": 1e-6,
                "logp_gap_max": 1e-5,
                "rollout_s": 1.0,
                "update_s": 0.5,
                "generated_rollouts": groups * size,
                "loss": float("nan"),
            }
        )
        rollouts.append({"iteration": it, "rewards": rewards, "trained": [True] * groups})
        for g in range(groups):
            rows = [
                {
                    "reward_token": tokens[g][r],
                    "reward": rewards[g][r],
                    "state_ok": r % 3 != 0,
                    "action_ok": bool(rewards[g][r]),
                    "error_type": None if rewards[g][r] else "state_mismatch",
                    "env_error": None,
                    "advantage": rewards[g][r] - 0.5,
                    "truncated": False,
                    "messages": [
                        {"role": "system", "content": "You are a file agent."},
                        {"role": "user", "content": f"task {it}-{g}: copy a.txt"},
                        {"role": "assistant", "content": f"cp(source='a.txt') row {r} {INJECTED}"},
                        {"role": "tool", "name": "cp", "content": "ok"},
                    ],
                }
                for r in range(size)
            ]
            groups_out.append(
                {
                    "iteration": it,
                    "round": 0,
                    "group": g,
                    "groups_in_iteration": groups + 1,
                    "task_id": f"t{it}_{g}",
                    "category": "base",
                    "kind": "copy",
                    "trained": g != 1,
                    "dropped": g == 1,
                    "rows": rows,
                }
            )
    tasks = lambda end: [
        {
            "task_id": f"h{i}",
            "category": "base",
            "kind": "copy",
            "success": (i % 4 != 1) if end else i % 3 != 0,
            "error_type": None,
            "messages": [{"role": "user", "content": f"held-out {i}"}],
        }
        for i in range(12)
    ]
    heldout = [
        {"iteration": 0, "trajectories": 0, "token": "high", "success": 0.5, "tasks": tasks(False)},
        {
            "iteration": iterations,
            "trajectories": iterations * groups * size,
            "token": "high",
            "success": 0.6,
            "tasks": tasks(True),
        },
    ]
    for name, recs in (
        ("metrics", metrics),
        ("rollouts", rollouts),
        ("trajectories", groups_out),
        ("heldout", heldout),
    ):
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (workdir / "config.json").write_text(
        json.dumps(
            {
                "config": {"seed": 1, "rl": {"steps": iterations, "p_high": 0.5}},
                "defaults": {"seed": 0, "rl": {"steps": 100, "p_high": 0.5}},
            }
        )
    )
    return workdir


# ------------------------------------------------------------------------------ the browser


def chromium():
    """A headless Chromium WebDriver with a fresh profile and no network, or a skip (a fail
    under CI=true) where the browser, its driver or Selenium is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("the selenium package")
    if missing:
        why = f"headless Chromium needs {', '.join(missing)} (apt: chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='rcgrpo-chromium-')}")
    options.add_argument("--proxy-server=http://127.0.0.1:9")  # any network use fails
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def _open(driver, page: Path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(page.resolve().as_uri())
    WebDriverWait(driver, 60).until(
        lambda d: d.execute_script(
            "return document.body.dataset.ready === '1'"
            " || document.getElementById('subtitle')"
            ".textContent.startsWith('error')"
        )
    )
    assert driver.execute_script("return document.body.dataset.ready") == "1", driver.find_element(
        "id", "subtitle"
    ).text


def _pick(driver, select_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", select_id)).select_by_value(value)


def _tab(driver, name: str) -> None:
    driver.find_element("id", f"tab-{name}").click()


def check_page(driver, run_dir: Path, arm: str | None = None) -> None:
    """The assertions on `run_dir`'s report.html, against the run's own files: no console
    errors; per iteration of `arm` (default: the first arm with trajectories) the trajectories
    drawn equal trajectories.jsonl's and, where every group is kept, rollouts.jsonl's; the
    filter reward 0 under <|high_reward|> shows exactly the matching rows; a click shows a
    conversation's text; "fixed by RL" counts what heldout.jsonl says."""
    arm_dirs = (
        [run_dir]
        if (run_dir / "rollouts.jsonl").exists()
        else sorted(p for p in run_dir.iterdir() if (p / "trajectories.jsonl").exists())
    )
    assert arm_dirs, f"{run_dir}: no trajectories.jsonl to check the page against"
    arm_dir = run_dir / arm if arm else arm_dirs[0]
    name = arm_dir.name
    groups = _records(arm_dir / "trajectories.jsonl")
    rollouts = {r["iteration"]: r for r in _records(arm_dir / "rollouts.jsonl")}
    _open(driver, run_dir / "report.html")
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors

    _tab(driver, "rollouts")
    _pick(driver, "f-arm", name)
    iterations = sorted({g["iteration"] for g in groups})
    for it in iterations[:3]:
        _pick(driver, "f-iter", str(it))
        drawn = driver.find_elements("css selector", "#rollout-list .traj")
        kept = [g for g in groups if g["iteration"] == it]
        assert len(drawn) == sum(len(g["rows"]) for g in kept)
        if all(len(kept) == g["groups_in_iteration"] for g in kept):  # every group kept
            assert len(drawn) == len(sum(rollouts[it]["rewards"], []))

    # reward 0 under <|high_reward|>: on one iteration, the rows drawn; over all, the count
    _pick(driver, "f-token", "high")
    _pick(driver, "f-reward", "0")  # as the page writes the number 0.0
    match = lambda g: [r for r in g["rows"] if r["reward_token"] == "high" and r["reward"] == 0]
    it = next((g["iteration"] for g in groups if match(g)), iterations[0])
    _pick(driver, "f-iter", str(it))
    cards = driver.find_elements("css selector", "#rollout-list .traj")
    want = [r for g in groups if g["iteration"] == it for r in match(g)]
    assert len(cards) == len(want)
    assert all(HIGH_TOKEN in c.text and "reward 0" in c.text for c in cards)
    _pick(driver, "f-iter", "any")
    status = driver.find_element("id", "rollout-status")
    assert int(status.get_attribute("data-trajectories")) == sum(len(match(g)) for g in groups)

    # a click shows the conversation, as text (model text that looks like HTML included)
    _pick(driver, "f-token", "any")
    _pick(driver, "f-reward", "any")
    _pick(driver, "f-iter", str(iterations[0]))
    driver.find_element("css selector", "#rollout-list .traj").click()
    shown = driver.find_element("css selector", "#rollout-list .conv").text
    first = next(g for g in groups if g["iteration"] == iterations[0])["rows"][0]
    assistant = [m["content"] for m in first["messages"] if m["role"] == "assistant"]
    assert assistant and assistant[0].strip() and assistant[0].strip()[:40] in shown
    assert driver.execute_script("return document.body.dataset.pwned") is None

    # held-out: "fixed by RL" (failed at the first evaluation, passed at the last)
    _tab(driver, "heldout")
    _pick(driver, "h-arm", name)
    _pick(driver, "h-change", "fixed")
    evals = sorted(_records(arm_dir / "heldout.jsonl"), key=lambda e: e["iteration"])
    start = {t["task_id"]: t["success"] for t in evals[0]["tasks"]}
    fixed = sum(t["success"] and not start.get(t["task_id"], True) for t in evals[-1]["tasks"])
    status = driver.find_element("id", "heldout-status")
    assert int(status.get_attribute("data-tasks")) == fixed
    assert len(driver.find_elements("css selector", "#heldout-table tr.task")) == fixed
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


# ------------------------------------------------------------------------------ tests


def test_page_of_an_arm_in_chromium(tmp_path, browser):
    run = write_fake_arm(tmp_path / "rctp_rcgrpo")
    page = report.build(run)
    assert page == run / "report.html"
    html = page.read_text()
    assert not any(f'{a}="http' in html for a in ("src", "href"))  # nothing to fetch
    check_page(browser, run)
    # the fake run's fixed-by-RL count is known: i % 3 == 0 and i % 4 != 1, i < 12 -> 0, 3, 6
    assert int(browser.find_element("id", "heldout-status").get_attribute("data-tasks")) == 3


def test_config_as_it_differs_from_the_defaults():
    got = changed(
        {"seed": 1, "rl": {"steps": 2, "p_high": 0.5, "arms": ("a",)}, "new": 3},
        {"seed": 0, "rl": {"steps": 2, "p_high": 0.5, "arms": ["a"]}},
    )
    assert got == [["new", 3, None], ["seed", 1, 0]]


def test_the_command_line_rebuilds_the_page(tmp_path):
    run = write_fake_arm(tmp_path / "arm", iterations=2)
    out = subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.tools.report", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (run / "report.html").stat().st_size > 0 and "report.html" in out.stdout
    (tmp_path / "empty").mkdir()
    bad = subprocess.run(
        [sys.executable, "-m", "rcgrpo_jax.tools.report", str(tmp_path / "empty")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


def test_refresh_warns_and_never_raises(tmp_path, capsys):
    assert report.refresh(tmp_path / "absent") is None
    assert "report.html not written" in capsys.readouterr().err


def _study_run(i: int) -> dict:
    """A stage `all` summary of run i whose two RL arms have curves over 3 budget points."""
    arms = {}
    for k, name in enumerate(("sft_grpo", "rctp_rcgrpo")):
        success = [0.5 + 0.1 * k, 0.55 + 0.1 * k + 0.01 * i, 0.6 + 0.1 * k + 0.02 * i]
        points = [
            {"rollouts": 64 * p, "success": s, "budget_point": p} for p, s in enumerate(success)
        ]
        arms[name] = {
            "start_success": success[0],
            "heldout_success": success[-1],
            "auc": sum(success) / 3,
            "curve": {"budget": 128, "points": points},
        }
    return {"arms": arms, "targets": {"moved": {}}, "wall_s": 10.0 + i}


def test_study_page_in_chromium(tmp_path, browser):
    from rcgrpo_jax.tools.seed_stats import aggregate, distinct

    runs = {f"seed_{i}": _study_run(i) for i in range(3)}
    runs["seed_1@avx2"] = _study_run(1)  # a whole repeat
    runs["seed_2@avx2"] = _study_run(2)
    runs["seed_2@avx2"]["arms"]["sft_grpo"]["heldout_success"] = 0.1  # one arm repeats
    study = tmp_path / "study"
    study.mkdir()
    (study / "seeds.json").write_text(json.dumps({"runs": runs, **aggregate(*distinct(runs))}))
    report.build(write_fake_arm(study / "seed_0", iterations=1))  # one run has its own page
    _open(browser, report.build(study))
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    rows = browser.find_elements("css selector", "#overview table:first-of-type tr")
    assert len(rows) == 1 + 2  # the head, then one row per arm
    assert "± " in rows[1].text
    _tab(browser, "curves")
    traces = browser.execute_script(
        "return document.querySelector('#curves .js-plotly-plot').data.length"
    )
    assert traces == 2 * 2  # per arm its band and its mean
    _tab(browser, "runs")
    links = browser.find_elements("css selector", "#runs a")
    assert [a.get_attribute("href").split("/")[-2:] for a in links] == [["seed_0", "report.html"]]
    said = "seed_1@avx2 = seed_1; seed_2@avx2's rctp_rcgrpo = seed_2's"
    assert said in browser.find_element("css selector", "#runs").text
