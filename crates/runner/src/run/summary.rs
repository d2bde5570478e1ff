//! The summary a finished run prints: final metrics per config, a deployment's win rates, a
//! learning policy's held-out reward.

use crate::plan::{ConfigPlan, Plan};
use crate::rows::MetricRow;
use crate::world::World;
use crate::{results, spec};

/// The last metric row of each seed of config `c`; None (and a line saying so, in a column of
/// `width`) when every seed failed.
fn finals<'a>(outcomes: &'a [results::CellOutcome<'_>], c: &ConfigPlan, width: usize) -> Option<Vec<&'a MetricRow>> {
    let rows: Vec<&MetricRow> = outcomes
        .iter()
        .filter(|o| o.config.config_id == c.config_id)
        .filter_map(|o| o.result.as_ref().ok().and_then(|r| r.rows.last()))
        .collect();
    if rows.is_empty() {
        eprintln!("{:<width$} (every seed failed)", c.label);
        return None;
    }
    Some(rows)
}

/// Final metrics per config, mean over seeds.
pub(super) fn print_summary(plan: &Plan, world: &World, outcomes: &[results::CellOutcome<'_>]) {
    if world.generated.is_some() && world.spec.setting == spec::Setting::Deploy {
        print_deploy_summary(plan, outcomes, world.online.is_none());
        if world.online.is_some() {
            eprint!("{}", policy_summary(outcomes));
        }
        return;
    }
    eprintln!("{:<44} {:>8} {:>10} {:>10} {:>12}", "config", "eval_acc", "theta_err", "subopt", "regret");
    for c in &plan.configs {
        let Some(finals) = finals(outcomes, c, 44) else { continue };
        let n = finals.len() as f64;
        let mean = |f: &dyn Fn(&MetricRow) -> f64| finals.iter().map(|r| f(r)).sum::<f64>() / n;
        let opt = |f: &dyn Fn(&MetricRow) -> Option<f64>, digits: usize| {
            if f(finals[0]).is_some() {
                format!("{:.digits$}", mean(&|r| f(r).unwrap_or(f64::NAN)))
            } else {
                "-".into()
            }
        };
        eprintln!(
            "{:<44} {:>8.4} {:>10} {:>10} {:>12}",
            c.label,
            mean(&|r| r.eval_accuracy),
            opt(&|r| r.theta_err, 4),
            opt(&|r| r.subopt, 4),
            opt(&|r| r.regret, 3)
        );
    }
}

/// A run with a learning policy: the held-out policy reward per arm, chunk 0 → the last
/// evaluation, over seeds with its t-interval ([`crate::report::policy_console`]).
fn policy_summary(outcomes: &[results::CellOutcome<'_>]) -> String {
    let rows: Vec<crate::report::Row> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok().map(|r| (o, r)))
        .flat_map(|(o, r)| r.policy.iter().map(move |p| crate::report::policy_row(o.config.label.clone(), o.seed, p)))
        .collect();
    crate::report::policy_console(&rows)
}

/// Chunked deployment: cumulative metrics at the last chunk (mean over seeds) and win rates;
/// `chunk_policy`: the mean over chunks of the oracle reward of the chunk's samples (a run
/// with a learning policy prints the held-out policy reward instead).
fn print_deploy_summary(plan: &Plan, outcomes: &[results::CellOutcome<'_>], chunk_policy: bool) {
    let wins = results::win_rates(plan, outcomes);
    let policy_head = if chunk_policy { format!(" {:>8}", "policy") } else { String::new() };
    eprintln!(
        "{:<34} {:>9} {:>9} {:>9}{policy_head} {:>8} {:>7} {:>7}",
        "config", "cum_pair", "mean_rew", "regret", "tau", "win/ch", "win/pr"
    );
    for c in &plan.configs {
        let Some(finals) = finals(outcomes, c, 34) else { continue };
        let n = finals.len() as f64;
        let mean = |f: &dyn Fn(&MetricRow) -> Option<f64>| finals.iter().filter_map(|r| f(r)).sum::<f64>() / n;
        // the mean over the run of the chunks' policy reward and τ
        let all: Vec<&MetricRow> = outcomes
            .iter()
            .filter(|o| o.config.config_id == c.config_id)
            .filter_map(|o| o.result.as_ref().ok())
            .flat_map(|r| r.rows.iter())
            .collect();
        let avg = |f: &dyn Fn(&MetricRow) -> Option<f64>| {
            all.iter().filter_map(|r| f(r)).sum::<f64>() / all.len().max(1) as f64
        };
        let w = &wins[c.config_id];
        let policy = if chunk_policy { format!(" {:>8.4}", avg(&|r| r.policy_reward)) } else { String::new() };
        eprintln!(
            "{:<34} {:>9.3} {:>9.4} {:>9.2}{policy} {:>8.3} {:>7.3} {:>7.3}",
            c.label,
            mean(&|r| r.cum_pair_reward),
            mean(&|r| r.mean_reward),
            mean(&|r| r.regret),
            avg(&|r| r.kendall_tau),
            w.chunk_wins / w.chunks.max(1) as f64,
            w.prompt_wins / w.prompts.max(1) as f64
        );
    }
}
