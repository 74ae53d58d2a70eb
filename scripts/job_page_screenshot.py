"""Pictures of the job page on a judge-bound clarify run, for docs/usage.md.

Runs the judge-bound job the benchmarks share (`bench.judge_bound`) (the clarify task with the
multiturn-aware reward; the user simulator and the interactivity judge behind the judge
proxy, served by the stand-in provider with its latency model) for `--steps` steps with a
held-out round every `--eval-every`, then opens `/jobs/{id}` in headless Chromium and saves:
- `job_page.png`: the status, the health events and the curves;
- `job_page_groups.png`: a training group opened, its best and worst response side by side,
  one future opened to the simulator's and the policy's turns and the judge's verdict.

    python -m scripts.job_page_screenshot [--warm-policy DIR] [--steps 12] [--out /tmp/tandem-page]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from bench.harness import REPO, rig, run_job
from bench.judge_bound import base_spec
from devtools.browser import chromium


def judge_bound_job(out: Path, args: argparse.Namespace) -> dict:
    spec = base_spec(out, args.steps) | {"name": "judge-bound-clarify"}
    spec["eval"] = {"every": args.eval_every, "examples": args.eval_examples}
    if args.warm_policy:
        spec["model"]["path"] = str(Path(args.warm_policy).resolve())
        spec["warm_start"] = {"steps": 0}
    return spec


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the page did not show {what} in {timeout_s:.0f} s")
        time.sleep(0.2)


def photograph(page_url: str, images: Path) -> None:
    """The page's top, then its group browser with a group and a future opened."""
    driver = chromium(1400, 1500)
    try:
        driver.get(page_url)
        wait_until(lambda: driver.execute_script("return document.body.dataset.loaded === 'true'"), 60, "the job")
        driver.save_screenshot(str(images / "job_page.png"))
        # The lowest-reward group with spread: where a person looks first.
        driver.find_element("css selector", "#group-order option[value='lowest']").click()
        wait_until(
            lambda: "order=lowest" in driver.find_element("id", "groups").get_attribute("data-drawn"), 30, "groups"
        )
        rows = driver.find_elements("css selector", "#groups tbody tr")
        spread = [
            r
            for r in rows
            if r.find_elements("css selector", "td")[4].text != r.find_elements("css selector", "td")[6].text
        ]
        (spread or rows)[0].click()
        future = driver.find_element("css selector", "#group [data-side=best] details.future")
        future.find_element("css selector", "summary").click()
        section = driver.find_element("id", "group").find_element("xpath", "./..")
        driver.execute_script("arguments[0].scrollIntoView()", section)
        driver.set_window_size(1400, max(1500, section.size["height"] + 200))
        section.screenshot(str(images / "job_page_groups.png"))
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-examples", type=int, default=16)
    parser.add_argument("--warm-policy", help="start from this policy folder (skips the warm start)")
    parser.add_argument("--tpm", type=int, default=1_500_000, help="the stand-in provider's tokens per minute")
    parser.add_argument("--out", default="/tmp/tandem-page", help="the run's files")
    parser.add_argument("--images", default=str(REPO / "docs" / "img"), help="where the pictures go")
    args = parser.parse_args()
    out, images = Path(args.out), Path(args.images)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    images.mkdir(parents=True, exist_ok=True)
    with rig(out, stand_in=(args.tpm, 10_000, 0)) as r:
        job_id = run_job(r, judge_bound_job(out, args))["job_id"]
        photograph(f"{r.stack.api_url}/jobs/{job_id}", images)
    print(f"wrote {images / 'job_page.png'} and {images / 'job_page_groups.png'}")


if __name__ == "__main__":
    main()
