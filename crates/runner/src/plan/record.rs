//! The resolved spec as a file (`spec.resolved.toml`, and what `--dry-run` prints): a spec that
//! `onepass run` takes back and that runs the same cells to the same bytes. It holds exactly
//! the keys that apply to the run's setting and `env.kind` — the ones the plan would refuse as
//! written anywhere else are left out — every default filled in, one `[[estimator]]` per
//! config, and what the data told (d, the bank's shape, the pairs) as values where a spec may
//! state them and as a comment where it may not.

use super::Plan;
use crate::spec::{EnvKind, Order, Setting, Spec};

/// The env keys that apply to one `env.kind` only (or not to it): the plan's `check_env_kind`
/// refuses them written under another kind, so the record leaves them out there.
const SYNTHETIC_ONLY: [&str; 6] = ["contexts", "fresh_contexts", "arms", "features", "feature_norm", "theta_norm"];

/// `plan.resolved(spec)` as TOML with only the keys that apply (see the module doc). `spec` is
/// the world's (completed with the data's facts by `plan::resolve`) or, for `--dry-run`, the
/// plan's: then what only the data can tell (env.dim of a dataset, a deployment's pairs) is
/// left out rather than shown as a placeholder.
pub fn resolved_text(plan: &Plan, spec: &Spec) -> Result<String, String> {
    let s = plan.resolved(spec);
    let mut t = toml::Table::try_from(&s).map_err(|e| format!("serialising the resolved spec: {e}"))?;
    let facts = spec.data_scale.is_some();
    prune(&mut t, &s, facts);
    let body = toml::to_string(&t).map_err(|e| format!("serialising the resolved spec: {e}"))?;
    let mut head = String::from(
        "# The spec as it ran: every key that applied, defaults filled in, one [[estimator]]\n\
         # per config; `onepass run` of this file runs the same cells to the same tables.\n\
         # Relative paths are relative to the directory onepass ran in (meta.json's `cwd`).\n",
    );
    if let Some(scale) = spec.data_scale.filter(|d| d.pairs > 0) {
        head.push_str(&format!(
            "# from the data: d = {}; median ‖z‖² = {} over the first {} pairs (λ = \"auto\" takes it)\n",
            spec.env.dim, scale.median_z_sq, scale.pairs
        ));
    }
    if !facts && spec.env.kind != EnvKind::Synthetic {
        head.push_str("# (--dry-run: env.dim and the data's shape come from the data once it is read)\n");
    }
    Ok(format!("{head}\n{body}"))
}

fn remove(t: &mut toml::Table, table: &str, keys: &[&str]) {
    if let Some(toml::Value::Table(sub)) = t.get_mut(table) {
        for k in keys {
            sub.remove(*k);
        }
    }
}

/// Leaves out what does not apply to `s`'s setting and env.kind.
fn prune(t: &mut toml::Table, s: &Spec, facts: bool) {
    for (table, setting) in [("passive", Setting::Passive), ("active", Setting::Active), ("deploy", Setting::Deploy)] {
        if s.setting != setting {
            t.remove(table);
        }
    }
    match s.env.kind {
        EnvKind::Synthetic => remove(t, "env", &["path", "eval_path", "order", "order_path"]),
        EnvKind::Features => remove(t, "env", &SYNTHETIC_ONLY),
        EnvKind::Dataset => {
            remove(t, "env", &SYNTHETIC_ONLY);
            remove(t, "env", &["path", "eval_path", "eval_pairs"]);
        }
        EnvKind::Generated => {
            remove(t, "env", &SYNTHETIC_ONLY);
            remove(t, "env", &["path", "eval_path", "order", "order_path"]);
        }
    }
    if s.env.order != Order::Indices {
        remove(t, "env", &["order_path"]);
    }
    if s.env.kind != EnvKind::Generated {
        remove(t, "deploy", &["chunks", "prompt_order", "policy", "reset_each_chunk"]);
    }
    if matches!(s.env.kind, EnvKind::Features | EnvKind::Dataset) {
        remove(t, "active", &["pool"]);
    }
    if !facts && s.env.kind != EnvKind::Synthetic {
        // a placeholder, not the data's d
        remove(t, "env", &["dim"]);
        if s.env.kind == EnvKind::Generated && s.setting == Setting::Deploy {
            remove(t, "stream", &["samples"]);
        }
    }
}
