//! `kvx settings`: the connector's settings, from the one table (`kvx_vllm::settings`): each
//! key, what it takes, its default and what it means; as a Markdown table or as JSON.

use kvx_vllm::settings::{self, Kind, Value};

/// `kvx settings` arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct SettingsArgs {
    /// Print JSON (one object per setting) instead of a Markdown table.
    #[arg(long)]
    json: bool,
}

fn default_text(value: &Value) -> String {
    match value {
        Value::Unset => "unset".to_owned(),
        other => other.to_string(),
    }
}

fn kind_text(kind: Kind) -> String {
    match kind {
        Kind::Choice(words) => format!("one of {}", words.join(", ")),
        Kind::Milliseconds { max } => format!("milliseconds, 0 to {max}"),
        other => other.name().replace('_', " "),
    }
}

/// The settings as printed.
pub(crate) fn render(json: bool) -> String {
    if json {
        let rows: Vec<serde_json::Value> = settings::SETTINGS
            .iter()
            .map(|s| {
                serde_json::json!({
                    "key": s.key,
                    "field": s.field,
                    "kind": s.kind.name(),
                    "default": default_text(&s.default),
                    "doc": s.doc,
                })
            })
            .collect();
        return serde_json::to_string_pretty(&rows).unwrap_or_default() + "\n";
    }
    let mut out = String::from(
        "| key | takes | default | connector field | meaning |\n|---|---|---|---|---|\n",
    );
    for s in settings::SETTINGS {
        out.push_str(&format!(
            "| `{}` | {} | `{}` | {} | {} |\n",
            s.key,
            kind_text(s.kind),
            default_text(&s.default),
            s.field
                .map_or("(vLLM plugin)".to_owned(), |f| format!("`{f}`")),
            s.doc
        ));
    }
    out
}

/// Runs `kvx settings`.
pub(crate) fn run(args: &SettingsArgs) -> anyhow::Result<()> {
    print!("{}", render(args.json));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_listed_in_both_forms() {
        let table = render(false);
        let json: serde_json::Value = serde_json::from_str(&render(true)).unwrap();
        assert_eq!(json.as_array().unwrap().len(), settings::SETTINGS.len());
        for s in settings::SETTINGS {
            assert!(table.contains(&format!("| `{}` |", s.key)), "{}", s.key);
        }
        assert!(table.contains("| `quiesce_timeout_s` | optional seconds | `unset` |"));
    }
}
