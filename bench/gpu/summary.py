"""The GPU check's report as markdown: the run's budget (each section's work and start-up
allowance, their sum), each section's status, time and summary lines, and every failed check with
what it compared."""

from __future__ import annotations


def markdown(report: dict) -> str:
    env = report.get("sections", {}).get("environment", {})
    device = env.get("gpu") or env.get("host") or report.get("device")
    lines = [f"# GPU check: {device}" + (" (smoke)" if report.get("smoke") else ""), "",
             f"commit {report.get('commit', '?')}, {report.get('date', '?')}, torch {env.get('torch', '?')}, "
             f"CUDA {env.get('cuda', '?')}; {report.get('seconds', '?')} s of a {report.get('budget_s', '?')} s budget", "",
             *_budget(report), "| section | status | seconds | of which start-up | allotted |",
             "| --- | --- | --- | --- | --- |"]
    sections = report.get("sections", {})
    for name, out in sections.items():
        lines.append(f"| {name} | {out.get('status', 'running')} | {out.get('seconds', '')} | {out.get('startup_s', '')} "
                     f"| {out.get('allotted_s', '')} |")
    for name, out in sections.items():
        lines += ["", f"## {name}", ""]
        if out.get("error"):
            lines.append(f"- **{out.get('status')}**: {out['error']}")
        lines += [f"- {line}" for line in out.get("summary", [])]
        for check_name, c in out.get("checks", {}).items():
            if not c["ok"]:
                lines.append(f"- FAILED: {check_name}: {c.get('detail')}")
        for goal_name, g in out.get("goals", {}).items():
            lines.append(f"- goal {'met' if g['met'] else 'NOT met'}: {goal_name} ({_figure(g.get('value'))})")
    return "\n".join(lines) + "\n"


def _budget(report: dict) -> list[str]:

    lines = []
    if report.get("budget"):
        lines.append(f"- this run's budget: {budget_line(report['budget'])}")
    if report.get("plan_accounting") and report.get("smoke"):
        lines.append(f"- on a GPU the plan takes: {budget_line(report['plan_accounting'])}")
    return lines + ([""] if lines else [])


def _figure(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def budget_line(accounting: dict) -> str:
    """One line of a run's budget: each section's work + start-up, the sums, the total."""
    parts = ", ".join(f"{n} {r['run_s']:g}+{r['startup_s']:g}" for n, r in accounting["sections"].items())
    plan = f"plan {accounting['plan']}: " if accounting.get("plan") else ""
    return (f"{plan}{parts} s = {accounting['run_sum_s']:g} s of work + {accounting['startup_sum_s']:g} s of start-up "
            f"= {accounting['sum_s']:g} s of {accounting['total_s']:g} s" + ("" if accounting["fits"] else
                                                                          " (over: the last sections are cut short)"))
