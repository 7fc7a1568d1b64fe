//! The module graph of each workspace crate: which top-level modules of a crate name which
//! others (`crate::X`, outside comments and test code), and the cycles among them, which
//! `cargo xtask test` refuses (docs/architecture.md, "No import cycles").
//!
//! Test code is left out: `#[cfg(test)] mod tests { … }` blocks at the end of a file, and the
//! files of test-only modules (`tests.rs`, `sim.rs`, `fuzz.rs`, `sim_support.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Context as _};

/// Files that hold only test code.
const TEST_FILES: [&str; 4] = ["tests.rs", "sim.rs", "fuzz.rs", "sim_support.rs"];

/// A crate's top-level modules and the others each names.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// Fails naming every cycle among the top-level modules of a crate under `crates/`.
pub(crate) fn check(root: &Path) -> anyhow::Result<()> {
    let mut found = Vec::new();
    let crates = root.join("crates");
    for entry in std::fs::read_dir(&crates).context("cannot read crates/")? {
        let src = entry?.path().join("src");
        if !src.is_dir() {
            continue;
        }
        let graph = graph_of(&src)?;
        for cycle in cycles(&graph) {
            let name = src
                .parent()
                .and_then(Path::file_name)
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            found.push(format!("{name}: {}", cycle.join(" → ")));
        }
    }
    if !found.is_empty() {
        bail!(
            "import cycles among top-level modules:\n  {}",
            found.join("\n  ")
        );
    }
    println!("    no import cycle among any crate's top-level modules");
    Ok(())
}

/// The modules a crate root (`lib.rs`, `main.rs` in `src`) re-exports from a top-level one
/// (`pub use transport::{board, region};`): their names, each with the module that holds it.
fn aliases(src: &Path) -> BTreeMap<String, String> {
    let mut aliases = BTreeMap::new();
    for root in ["lib.rs", "main.rs"] {
        let Ok(text) = std::fs::read_to_string(src.join(root)) else {
            continue;
        };
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for statement in code.split(';') {
            let Some(path) = statement.split("use ").nth(1) else {
                continue;
            };
            let Some((top, rest)) = path.trim().split_once("::") else {
                continue;
            };
            // Plain names only (`{board, region}`, `wake`), not paths or types.
            let names = rest.trim().trim_start_matches('{').trim_end_matches('}');
            for name in names.split(',').map(str::trim) {
                if ident(name).as_deref() == Some(name) {
                    aliases.insert(name.to_owned(), top.trim().to_owned());
                }
            }
        }
    }
    aliases
}

/// The graph of the crate whose sources are in `src`.
fn graph_of(src: &Path) -> anyhow::Result<Graph> {
    let aliases = aliases(src);
    let mut graph = Graph::new();
    let mut todo = vec![src.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                todo.push(path);
                continue;
            }
            let file = path.file_name().unwrap_or_default().to_string_lossy();
            if !file.ends_with(".rs") || TEST_FILES.contains(&file.as_ref()) {
                continue;
            }
            let relative = path.strip_prefix(src)?;
            let top = relative
                .components()
                .next()
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_owned()
                })
                .unwrap_or_default();
            if top == "lib" || top == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path)?;
            let named = graph.entry(top.clone()).or_default();
            for module in names(&text) {
                // A module re-exported at the root is named by where it lives.
                let module = aliases.get(&module).cloned().unwrap_or(module);
                if module != top {
                    named.insert(module);
                }
            }
        }
    }
    Ok(graph)
}

/// The modules `text` names as `crate::X` (or in `use crate::{X, …}`, over several lines too),
/// outside comments and before its test module.
fn names(text: &str) -> BTreeSet<String> {
    let code: String = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.extend(ident(rest));
            continue;
        };
        // The group's parts at its own depth: `{a::{B, C}, d}` names `a` and `d`.
        let (mut depth, mut part_start) = (0usize, 0usize);
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.extend(ident(group[part_start..i].trim()));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.extend(ident(group[part_start..i].trim()));
                    part_start = i + 1;
                }
                _ => {}
            }
        }
    }
    out
}

/// The module-like identifier at the start of `s` (lower case: types are not modules).
fn ident(s: &str) -> Option<String> {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    let word = &s[..end];
    word.starts_with(|c: char| c.is_ascii_lowercase())
        .then(|| word.to_owned())
}

/// The cycles of `graph` (its strongly connected components of more than one module), each
/// listed in order.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    // Tarjan's algorithm.
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.graph.contains_key(w) {
                continue;
            }
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !state.index.contains_key(v.as_str()) {
            visit(&mut state, v);
        }
    }
    state.found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &[&str])]) -> Graph {
        edges
            .iter()
            .map(|(m, to)| {
                (
                    (*m).to_owned(),
                    to.iter().map(|t| (*t).to_owned()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let chain = graph(&[("a", &["b"]), ("b", &["c"]), ("c", &[])]);
        assert!(cycles(&chain).is_empty());
        let looped = graph(&[("a", &["b"]), ("b", &["c"]), ("c", &["a"]), ("d", &["a"])]);
        assert_eq!(cycles(&looped), vec![vec!["a", "b", "c"]]);
    }

    #[test]
    fn this_workspace_has_none() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        check(root).unwrap();
    }

    #[test]
    fn names_skip_comments_types_and_tests() {
        let text = "use crate::error::Oops;\nuse crate::{region::Region, wake};\n\
                    use crate::{\n    board::{Board, Slot},\n    desc,\n};\n\
                    /// See [`x`](crate::doc_only).\nfn f() -> crate::Thing { crate::ids::next() }\n\
                    #[cfg(test)]\nmod tests {\n    use crate::sim;\n}\n";
        let want: BTreeSet<String> = ["board", "desc", "error", "ids", "region", "wake"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        assert_eq!(names(text), want);
    }
}
