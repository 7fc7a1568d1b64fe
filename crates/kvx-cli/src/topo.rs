//! `kvx topo`: each accelerator's PCI address, kind, NUMA node, RDMA rails and the rule that chose
//! them, read from sysfs (see `docs/topology.md`).

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use kvx_rdma::topology::{RailOverrides, Topology};
use serde::Serialize;

/// Show each accelerator's RDMA rails, chosen from the PCIe topology in sysfs.
#[derive(clap::Args, Debug)]
pub(crate) struct TopoArgs {
    /// Root of the sysfs tree to read (a copy of one works too).
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: PathBuf,
    /// Print JSON: {"accelerators":[{"pci","kind","numa","rails","rule"}]}.
    #[arg(long)]
    json: bool,
    /// Explicit mapping `PCI=NIC[,NIC...][;PCI=...]`, which overrides the rule for the
    /// accelerators it names; replaces the environment variable KVX_RAILS.
    #[arg(long, value_name = "MAP")]
    rails: Option<String>,
}

/// Runs `kvx topo`: prints the table (or JSON) on standard output.
pub(crate) fn run(args: &TopoArgs) -> anyhow::Result<()> {
    let out = render(args, std::env::var_os(RailOverrides::ENV_VAR))?;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
        .context("writing to standard output")
}

/// The whole output of `kvx topo` for these arguments, given the value of `KVX_RAILS`.
fn render(args: &TopoArgs, env_rails: Option<OsString>) -> anyhow::Result<String> {
    let topology = load(args, env_rails)?;
    if args.json {
        to_json(&topology)
    } else {
        Ok(to_table(&topology, &args.sysfs_root))
    }
}

/// Reads the topology and applies the explicit mapping (`--rails`, else `KVX_RAILS`).
fn load(args: &TopoArgs, env_rails: Option<OsString>) -> anyhow::Result<Topology> {
    let overrides = match &args.rails {
        Some(spec) => RailOverrides::parse(spec).context("invalid --rails")?,
        None => RailOverrides::from_env_value(env_rails)
            .with_context(|| format!("invalid {}", RailOverrides::ENV_VAR))?,
    };
    Topology::from_sysfs(&args.sysfs_root)
        .with_context(|| {
            format!(
                "reading the PCI topology under {}",
                args.sysfs_root.display()
            )
        })?
        .with_overrides(&overrides)
        .context("applying the explicit rail mapping")
}

/// The JSON report; field order is part of the format.
#[derive(Serialize)]
struct Report<'a> {
    accelerators: Vec<Entry<'a>>,
}

/// One accelerator of the JSON report.
#[derive(Serialize)]
struct Entry<'a> {
    pci: String,
    kind: &'static str,
    numa: Option<u32>,
    rails: &'a [String],
    rule: &'static str,
}

/// `{"accelerators":[...]}` on one line, accelerators in PCI-address order, rails sorted.
fn to_json(topology: &Topology) -> anyhow::Result<String> {
    let report = Report {
        accelerators: topology
            .selection()
            .map(|(acc, choice)| Entry {
                pci: acc.address.to_string(),
                kind: acc.kind.as_str(),
                numa: acc.numa_node,
                rails: &choice.rails,
                rule: choice.rule.as_str(),
            })
            .collect(),
    };
    let mut out = serde_json::to_string(&report).context("serialising the report")?;
    out.push('\n');
    Ok(out)
}

/// The human-readable table; says plainly when there is no accelerator.
fn to_table(topology: &Topology, root: &Path) -> String {
    let nics = topology.rdma_nics().len();
    let accelerators = topology.accelerators().len();
    let mut out = String::new();
    if accelerators == 0 {
        let _ = writeln!(
            out,
            "No accelerator found under {} (looked for NVIDIA GPUs and AWS Neuron devices): \
             no rails to select. Read {} PCI devices and {nics} RDMA NICs.",
            root.display(),
            topology.devices().count(),
        );
        return out;
    }
    let _ = writeln!(
        out,
        "{accelerators} accelerator{}, {nics} RDMA NIC{} (sysfs root {})",
        plural(accelerators),
        plural(nics),
        root.display()
    );
    let header = ["PCI", "KIND", "NUMA", "RULE", "RAILS"];
    let rows: Vec<[String; 5]> = topology
        .selection()
        .map(|(acc, choice)| {
            [
                acc.address.to_string(),
                acc.kind.to_string(),
                acc.numa_node
                    .map_or_else(|| "-".to_owned(), |n| n.to_string()),
                choice.rule.to_string(),
                if choice.rails.is_empty() {
                    "(none: the host has no RDMA NIC)".to_owned()
                } else {
                    choice.rails.join(",")
                },
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut line = |cells: [&str; 5]| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<w$}  ");
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    };
    line(header);
    for row in &rows {
        line(row.each_ref().map(String::as_str));
    }
    out
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_rdma::topology::{PciAddress, PciDevice, RailOverrides, RdmaNic};

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    /// Two GPUs, each on a switch with NICs (one has two, listed in reverse order), and a NIC on
    /// another root port.
    fn host() -> Topology {
        let sw1 = vec![a("0000:48:01.0"), a("0000:49:00.0"), a("0000:4a:00.0")];
        let sw2 = vec![a("0000:59:01.0"), a("0000:5a:00.0"), a("0000:5b:00.0")];
        let devices = vec![
            PciDevice::new(a("0000:53:00.0"), 0x10de, 0x2335, 0x03_02_00)
                .with_numa_node(Some(0))
                .with_ancestors(sw1.clone()),
            PciDevice::new(a("0000:4f:00.0"), 0x1d0f, 0xefa2, 0x02_00_00)
                .with_numa_node(Some(0))
                .with_ancestors(sw1.clone()),
            PciDevice::new(a("0000:50:00.0"), 0x1d0f, 0xefa2, 0x02_00_00)
                .with_numa_node(Some(0))
                .with_ancestors(sw1),
            PciDevice::new(a("0000:64:00.0"), 0x10de, 0x2335, 0x03_02_00)
                .with_ancestors(sw2.clone()),
            PciDevice::new(a("0000:60:00.0"), 0x1d0f, 0xefa2, 0x02_00_00).with_ancestors(sw2),
        ];
        let nics = vec![
            RdmaNic::new("rdmap96s0", a("0000:60:00.0")),
            RdmaNic::new("rdmap80s0", a("0000:50:00.0")),
            RdmaNic::new("rdmap79s0", a("0000:4f:00.0")),
        ];
        Topology::from_parts(devices, nics, Vec::new()).unwrap()
    }

    fn args(root: &Path, json: bool, rails: Option<&str>) -> TopoArgs {
        TopoArgs {
            sysfs_root: root.to_path_buf(),
            json,
            rails: rails.map(str::to_owned),
        }
    }

    #[test]
    fn json_has_the_documented_shape() {
        let out = to_json(&host()).unwrap();
        assert_eq!(
            out,
            concat!(
                r#"{"accelerators":["#,
                r#"{"pci":"0000:53:00.0","kind":"cuda","numa":0,"rails":["rdmap79s0","rdmap80s0"],"rule":"pcie-switch"},"#,
                r#"{"pci":"0000:64:00.0","kind":"cuda","numa":null,"rails":["rdmap96s0"],"rule":"pcie-switch"}"#,
                "]}\n"
            )
        );
    }

    #[test]
    fn json_shows_overrides() {
        let o = RailOverrides::parse("0000:64:00.0=rdmap80s0,rdmap79s0").unwrap();
        let t = host().with_overrides(&o).unwrap();
        let v: serde_json::Value = serde_json::from_str(&to_json(&t).unwrap()).unwrap();
        let second = &v["accelerators"][1];
        assert_eq!(second["rule"], "override");
        assert_eq!(
            second["rails"],
            serde_json::json!(["rdmap79s0", "rdmap80s0"])
        );
        assert_eq!(v["accelerators"][0]["rule"], "pcie-switch");
    }

    #[test]
    fn no_accelerator_is_an_empty_list_and_said_plainly() {
        let t = Topology::from_parts(
            vec![PciDevice::new(
                a("0000:00:05.0"),
                0x1d0f,
                0xec20,
                0x02_00_00,
            )],
            vec![],
            vec![],
        )
        .unwrap();
        assert_eq!(to_json(&t).unwrap(), "{\"accelerators\":[]}\n");
        let table = to_table(&t, Path::new("/fake/sys"));
        assert!(
            table.starts_with("No accelerator found under /fake/sys"),
            "{table}"
        );
        assert!(
            table.contains("Read 1 PCI devices and 0 RDMA NICs"),
            "{table}"
        );
    }

    #[test]
    fn table_lists_every_accelerator_in_aligned_columns() {
        let table = to_table(&host(), Path::new("/sys"));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "2 accelerators, 3 RDMA NICs (sysfs root /sys)");
        assert_eq!(lines.len(), 4, "{table}");
        let col = lines[1].find("RAILS").unwrap();
        assert!(lines[1].starts_with("PCI "));
        assert!(lines[2].starts_with("0000:53:00.0  cuda  0 "), "{table}");
        assert_eq!(&lines[2][col..], "rdmap79s0,rdmap80s0");
        assert!(lines[3].contains(" - "), "unknown NUMA shown as -: {table}");
        assert_eq!(&lines[3][col..], "rdmap96s0");
        let rule = lines[1].find("RULE").unwrap();
        assert!(lines[2][rule..].starts_with("pcie-switch"));
    }

    #[test]
    fn bad_inputs_are_errors_with_context() {
        let missing = std::env::temp_dir().join(format!("kvx-topo-missing-{}", std::process::id()));
        let e = render(&args(&missing, false, None), None).unwrap_err();
        assert!(
            format!("{e:#}").contains("reading the PCI topology under"),
            "{e:#}"
        );
        let e = render(&args(&missing, true, Some("0000:53:00.0")), None).unwrap_err();
        assert!(format!("{e:#}").contains("invalid --rails"), "{e:#}");
        let e = render(&args(&missing, true, None), Some("junk".into())).unwrap_err();
        assert!(format!("{e:#}").contains("invalid KVX_RAILS"), "{e:#}");
    }

    #[test]
    fn rails_flag_replaces_the_environment() {
        // A valid --rails wins over a malformed KVX_RAILS: the error is about sysfs, not KVX_RAILS.
        let missing = std::env::temp_dir().join(format!("kvx-topo-none-{}", std::process::id()));
        let e = render(
            &args(&missing, true, Some("0000:53:00.0=a")),
            Some("junk".into()),
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            !msg.contains("KVX_RAILS") && msg.contains("reading the PCI topology"),
            "{msg}"
        );
    }
}
