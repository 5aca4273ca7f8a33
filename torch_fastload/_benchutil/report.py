"""One benchmark run's record: the machine, the arguments, the results, the figures the record
cites, PASS/FAIL verdicts and failures; printed as tables and written as JSON + PNG."""

from __future__ import annotations

import time
import traceback

from .machine import machine_info
from .output import error_text, log, pyplot, write_json


class Study:
    """Collects one run. ``study["key"] = value`` stores results; ``figure()`` the headline
    numbers (the keys benchmarks/RESULTS.md cites); ``verdict()`` a target's outcome;
    ``attempt()`` runs a part and records its failure instead of ending the run; ``finish()``
    prints, writes and returns the exit code (1 if a part failed, 3 if ``strict`` and a target
    failed, else 0)."""

    def __init__(self, name: str, args, title: str):
        self.name, self.args = name, args
        args.out.mkdir(parents=True, exist_ok=True)
        self.json_path = args.json or args.out / f"{name}.json"
        self.png_path = self.json_path.with_suffix(".png")
        self.began = time.perf_counter()
        machine = machine_info(args.device.type == "cuda")
        self.data: dict = {
            "benchmark": f"benchmarks/{name}.py",
            "machine": machine,
            "args": dict(vars(args)),
            "figures": {},
            "verdicts": [],
            "failures": [],
        }
        cpus = machine["cpu_affinity"] or machine["cpu_count"]
        where = (machine.get("gpu") or {}).get("name") or "the CPU (a code-path run: numbers are not GPU results)"
        log(f"{title} on {where}: torch {machine['torch']}, python {machine['python']}, {cpus} CPUs, {machine['date']}")
        log(f"command: {machine['command_line']}")

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value) -> None:
        self.data[key] = value

    def get(self, key, default=None):
        return self.data.get(key, default)

    def figure(self, key: str, value) -> None:
        """A headline figure, compared with the record by ``benchmarks/compare.py``."""
        self.data["figures"][key] = value

    def verdict(self, target: str, passed: bool | None, value: str) -> None:
        """``passed`` None: reported, not judged (INFO)."""
        word = "INFO" if passed is None else ("PASS" if passed else "FAIL")
        self.data["verdicts"].append({"target": target, "verdict": word, "pass": passed, "value": value})

    def attempt(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, or None with the failure logged and recorded."""
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            log(f"  {what}: FAILED {error_text(exc)}")
            traceback.print_exc()
            self.data["failures"].append({"what": what, "error": error_text(exc), "traceback": traceback.format_exc()})
            return None

    def save(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - self.began
        write_json(self.json_path, self.data)

    def finish(self, *tables: str, plot=None, strict: bool = False) -> int:
        """Print ``tables``, draw ``plot(data, plt) -> figure`` into the PNG, write the JSON, then
        the verdicts last; the exit code."""
        for text in tables:
            if text:
                log("")
                log(text)
        wrote = [str(self.json_path)]
        plt = pyplot() if plot is not None else None
        if plt is not None:
            try:
                fig = plot(self.data, plt)
                if fig is not None:
                    fig.savefig(self.png_path, dpi=110)
                    plt.close(fig)
                    wrote.append(str(self.png_path))
            except Exception as exc:  # a plot never costs the numbers
                log(f"  (no plot: {error_text(exc)})")
        self.save()
        log("")
        if self.args.device.type == "cpu" and self.data["verdicts"]:
            log("(a CPU run: the verdicts below exercise the code, they judge nothing)")
        for v in self.data["verdicts"]:
            log(f"{v['verdict']:<4}  {v['target']}: {v['value']}")
        for f in self.data["failures"]:
            log(f"FAILED {f['what']}: {f['error']}")
        log(f"wrote {' and '.join(wrote)}")
        log(f"total time {time.perf_counter() - self.began:.1f} s")
        if self.data["failures"]:
            return 1
        return 3 if strict and any(v["pass"] is False for v in self.data["verdicts"]) else 0
