"""docs/configuration.md, generated from :data:`mpilb.config.options.OPTIONS` and
:data:`mpilb.config.options.NO_EFFECT` (``python -m mpilb.config.build > docs/configuration.md``).

It reads the option table only (mpilb.config.build imports it, not the other way round).
"""

from __future__ import annotations

from mpilb.config.options import NO_EFFECT, OPTION_BY_NAME, OPTIONS, Option


def reference_markdown() -> str:
    """docs/configuration.md, generated from OPTIONS (`python -m mpilb.config.build > docs/configuration.md`)."""
    lines = ["# Configuration reference", "",
             "Generated from `mpilb/config/build.py` by `python -m mpilb.config.build > docs/configuration.md`;",
             "a test fails when this page and the code disagree.", "",
             "Every option can be given on the command line (`--staleness-bound 2`) or in a TOML",
             "config file (`staleness_bound = 2` or `staleness-bound = 2`); the command line wins.",
             "Boolean options take `--name` / `--no-name`; `--inject` may be repeated (a list in TOML).", ""]
    groups: dict[str, list[Option]] = {}
    for opt in OPTIONS:
        groups.setdefault(opt.group, []).append(opt)
    for group, opts in groups.items():
        lines += [f"## {group.capitalize()}", "", "| option | type | default | allowed | meaning |",
                  "| --- | --- | --- | --- | --- |"]
        for o in opts:
            allowed = ", ".join(f"`{c}`" for c in o.choices) if o.choices else (o.check[1] if o.check else "")
            default = o.default_text or ("—" if o.default is None else f"`{o.default}`")
            lines.append(f"| `{o.flag}` | {o.type.__name__} | {default} | {allowed} | {o.help} |")
        lines.append("")
    lines += ["## Options that have no effect", "",
              "An option that does nothing given another option's value is refused when it is",
              "given on the command line, with a message naming both, e.g. `--hidden 999 has no",
              "effect with --model cnn (only the mlp has hidden layers)`: the run would not be the",
              "one asked for. Set in a config file, it is a warning (`mpilb: warning: run.toml:",
              "hidden = ... has no effect with ...; ignored`) and the run goes on: one file is",
              "often shared by runs that differ in a command-line option (`--model`, `--mode`),",
              "and a key that serves some of them should not stop the others.", "",
              "| option | depends on | why |", "| --- | --- | --- |"]
    for name, _, other, why in NO_EFFECT:
        lines.append(f"| `{OPTION_BY_NAME[name].flag}` | `{OPTION_BY_NAME[other].flag}` | {why} |")
    lines.append("| `--target-accuracy` | the dataset | accuracy is measured for classifiers only: "
                 "on float targets (regression, `num_classes` 0) use `--target-metric` |")
    lines.append("")
    return "\n".join(lines)
