//! `cargo xtask bench --against REV [NAME…]`: the criterion micro benchmarks of this checkout
//! beside those of revision `REV`, measured in turn on one machine in one run, so that a
//! change's cost is a ratio, not two figures from different days.
//!
//! `REV` is checked out as a git worktree under `target/kvx-against/<commit>/` (reused while it
//! exists) and builds there with its own target folder. Each round runs every bench of both
//! trees, alternating which goes first (ABBA), each tree with its own `CRITERION_HOME`; the
//! table gives each benchmark's median per tree (the median of the rounds' medians) and the
//! ratio this checkout / `REV`: below 1 is faster. The results also go to
//! `target/kvx-bench/against-<short commit>.json`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

use crate::bench::BENCHES;
use crate::{cargo, root, step};

/// The criterion benches a comparison covers (by name in [`BENCHES`]; `transfer` and `gpu`
/// have harnesses of their own).
const MICRO: [&str; 3] = ["plan", "codec", "rendezvous"];

/// One tree to measure.
struct Tree {
    label: String,
    dir: PathBuf,
    criterion_home: PathBuf,
}

/// Runs the comparison of `names` (all micro benches when empty) against `rev`, `rounds` times.
pub(crate) fn run(rev: &str, names: &[String], rounds: usize, quick: bool) -> anyhow::Result<()> {
    let selected: Vec<_> = BENCHES
        .iter()
        .filter(|(n, ..)| MICRO.contains(n))
        .filter(|(n, ..)| names.is_empty() || names.iter().any(|m| m == n))
        .collect();
    for name in names {
        if !MICRO.contains(&name.as_str()) {
            bail!(
                "`--against` compares the criterion micro benchmarks only ({}), not `{name}`",
                MICRO.join(", ")
            );
        }
    }
    let commit = git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .with_context(|| format!("`{rev}` is not a revision of this repository"))?;
    let short = &commit[..12.min(commit.len())];
    let base = root().join("target/kvx-against");
    let worktree = base.join(&commit);
    if !worktree.join("Cargo.toml").exists() {
        step(&format!("checking out {rev} ({short}) as a worktree"));
        fs::create_dir_all(&base).with_context(|| format!("cannot create {}", base.display()))?;
        let _ = git(&["worktree", "prune"]);
        crate::run(Command::new("git").args([
            "worktree",
            "add",
            "--detach",
            &worktree.display().to_string(),
            &commit,
        ]))?;
    }
    let trees = [
        Tree {
            label: short.to_owned(),
            dir: worktree.clone(),
            criterion_home: base.join(format!("criterion-{short}")),
        },
        Tree {
            label: "this checkout".to_owned(),
            dir: root(),
            criterion_home: base.join("criterion-head"),
        },
    ];
    // Build everything first, so that no build runs between measurements.
    for tree in &trees {
        for (name, package, target, _) in &selected {
            if !tree
                .dir
                .join(format!("crates/{package}/benches/{target}.rs"))
                .exists()
            {
                println!("    {}: has no `{name}` benchmark", tree.label);
                continue;
            }
            step(&format!("building {name} in {}", tree.label));
            crate::run(
                cargo()
                    .current_dir(&tree.dir)
                    .args(["bench", "--no-run", "-p", package, "--bench", target]),
            )?;
        }
    }
    // medians[bench id][tree index] = one median (ns) per round
    let mut medians: BTreeMap<String, [Vec<f64>; 2]> = BTreeMap::new();
    for round in 0..rounds {
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for index in order {
            let tree = &trees[index];
            for (name, package, target, groups) in &selected {
                if !tree
                    .dir
                    .join(format!("crates/{package}/benches/{target}.rs"))
                    .exists()
                {
                    continue;
                }
                step(&format!(
                    "round {} of {rounds}: {name} in {}",
                    round + 1,
                    tree.label
                ));
                let _ = fs::remove_dir_all(&tree.criterion_home);
                let mut cmd = cargo();
                cmd.current_dir(&tree.dir)
                    .env("CRITERION_HOME", &tree.criterion_home)
                    .env("KVX_BENCH_OUT", base.join("scratch"))
                    .args(["bench", "-p", package, "--bench", target, "--"]);
                if quick {
                    cmd.args(["--warm-up-time", "0.5", "--measurement-time", "1"]);
                }
                cmd.arg("--noplot");
                crate::run(&mut cmd)?;
                for group in groups.split(',') {
                    for (id, median) in read_medians(&tree.criterion_home, group)? {
                        medians.entry(id).or_default()[index].push(median);
                    }
                }
            }
        }
    }
    let table = render(&trees, &medians);
    println!("\n{table}");
    let out = root().join("target/kvx-bench");
    fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let path = out.join(format!("against-{short}.json"));
    let rows: Vec<serde_json::Value> = medians
        .iter()
        .map(|(id, [against, head])| {
            serde_json::json!({
                "id": id,
                "against_ns": against,
                "head_ns": head,
                "ratio": ratio(against, head),
            })
        })
        .collect();
    let report = serde_json::json!({ "against": commit, "rounds": rounds, "benches": rows });
    fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!("    results: {}", path.display());
    Ok(())
}

/// Every benchmark's median (ns per iteration) under `<home>/<group>`, by id `group/…`.
fn read_medians(home: &Path, group: &str) -> anyhow::Result<Vec<(String, f64)>> {
    let mut out = Vec::new();
    let mut stack = vec![home.join(group)];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            if path.file_name().is_some_and(|n| n == "new") {
                let file = path.join("estimates.json");
                let text = fs::read_to_string(&file)
                    .with_context(|| format!("cannot read {}", file.display()))?;
                let json: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("{} is not JSON", file.display()))?;
                let median = json["median"]["point_estimate"]
                    .as_f64()
                    .with_context(|| format!("{} has no median", file.display()))?;
                let id = dir.strip_prefix(home).unwrap_or(&dir).display().to_string();
                out.push((id, median));
            } else if path.file_name().is_some_and(|n| n != "report") {
                stack.push(path);
            }
        }
    }
    Ok(out)
}

fn median(values: &[f64]) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// This checkout's median over `REV`'s.
fn ratio(against: &[f64], head: &[f64]) -> Option<f64> {
    Some(median(head)? / median(against)?)
}

fn render(trees: &[Tree; 2], medians: &BTreeMap<String, [Vec<f64>; 2]>) -> String {
    let width = medians.keys().map(String::len).max().unwrap_or(10).max(10);
    let mut out = format!(
        "{:<width$}  {:>14}  {:>14}  {:>7}\n",
        "benchmark", trees[0].label, "this checkout", "ratio"
    );
    let show = |v: &[f64]| median(v).map_or("-".to_owned(), format_ns);
    for (id, [against, head]) in medians {
        let r = ratio(against, head).map_or("-".to_owned(), |r| format!("{r:.3}"));
        out.push_str(&format!(
            "{id:<width$}  {:>14}  {:>14}  {r:>7}\n",
            show(against),
            show(head)
        ));
    }
    out
}

fn format_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn git(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("git")
        .current_dir(root())
        .args(args)
        .output()
        .context("cannot run git")?;
    if !output.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}
