//! The report's figures (plotters; PNG and SVG), after the paper's layouts: small multiples with
//! one panel per estimator and one colour per strategy, rule or policy arm (Fig. 3, Fig. 4), or one
//! panel with a colour per config when the labels name only estimators (Fig. 2); a shared y axis,
//! the legend beside the panels, integer ticks for counts, seed bands light enough to see through;
//! a bar chart of time per config with the estimator's share (Fig. 3c); a win-rate heatmap.
//!
//! A config label is `estimator [hparams] [/ strategy-or-rule] [/ policy]` (plan.rs): the panel
//! is the part before the first " / ", the colour the rest. The colours are assigned once per run
//! ([`Layout`]) so a strategy keeps its colour in every figure of the run.

use super::row::{series, Row};
use super::stats::{mean_std, mean_t95};
use anyhow::{anyhow, bail, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;

/// Matplotlib's tab10: distinct, and familiar to readers of ML papers. A run with more colour
/// keys than ten draws the next ten dashed.
const TAB10: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

const LEGEND_W: u32 = 230;
const TITLE_H: u32 = 62;
const GRID: RGBColor = RGBColor(225, 225, 225);

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("{e:?}")
}

/// Panels and colours of a run's figures.
#[derive(Clone, Debug)]
pub struct Layout {
    /// labels hold " / ": a panel per estimator part, a colour per the rest
    split: bool,
    /// colour keys in order of first appearance (the plan's order of configs)
    keys: Vec<String>,
    /// what the colours stand for, for the legend's title
    pub legend_title: String,
}

impl Layout {
    /// The layout for a run whose configs are `labels` (in the plan's order; repeats allowed).
    pub fn new<'a>(labels: impl IntoIterator<Item = &'a str>, legend_title: &str) -> Layout {
        let labels: Vec<&str> = labels.into_iter().collect();
        let split = labels.iter().any(|l| l.contains(" / "));
        let mut keys: Vec<String> = Vec::new();
        for l in &labels {
            let k = if split { l.split_once(" / ").map_or(*l, |x| x.1) } else { l };
            if !keys.iter().any(|x| x == k) {
                keys.push(k.to_string());
            }
        }
        let legend_title = if split { legend_title.to_string() } else { "config".to_string() };
        Layout { split, keys, legend_title }
    }

    /// (panel, colour key) of a label.
    pub fn parts<'a>(&self, label: &'a str) -> (&'a str, &'a str) {
        match label.split_once(" / ") {
            Some((panel, key)) if self.split => (panel, key),
            _ => ("", label),
        }
    }

    /// The colour of a key and whether its line is dashed (keys beyond the palette).
    pub fn style(&self, key: &str) -> (RGBColor, bool) {
        let i = self.keys.iter().position(|k| k == key).unwrap_or(self.keys.len());
        (TAB10[i % TAB10.len()], (i / TAB10.len()) % 2 == 1)
    }
}

/// Tick labels with as many decimals as the axis' step needs, never "-0.0"; large or tiny
/// magnitudes in scientific form.
pub fn tick_formatter(lo: f64, hi: f64) -> impl Fn(&f64) -> String {
    let span = (hi - lo).abs().max(1e-300);
    let big = lo.abs().max(hi.abs());
    let step = span / 8.0;
    let decimals = (-step.log10().floor()).clamp(0.0, 6.0) as usize;
    let sci = big >= 1e5 || (big < 1e-3 && big > 0.0);
    move |v: &f64| {
        let s = if sci { format!("{v:.1e}") } else { format!("{v:.decimals$}") };
        // "-0.00" → "0.00": a rounded zero has no sign
        if s.starts_with('-') && s[1..].chars().all(|c| c == '0' || c == '.') {
            s[1..].to_string()
        } else {
            s
        }
    }
}

/// What a line figure's band around the mean over seeds is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Band {
    /// ± 1 sample standard deviation over seeds (0 for one seed).
    Sd,
    /// ± the half-width of the 95% Student-t interval of the mean (df = seeds − 1; none for one
    /// seed).
    T95,
}

impl Band {
    /// The mean of `v` and the band's half-width (0 where there is none: one value).
    pub fn of(self, v: &[f64]) -> (f64, f64) {
        match self {
            Band::Sd => mean_std(v),
            Band::T95 => {
                let (m, hw) = mean_t95(v);
                (m, hw.unwrap_or(0.0))
            }
        }
    }
}

/// One line of a figure as drawn: per x, (x, mean, half-width of the band), x ascending,
/// non-finite means left out.
pub fn curve(by: &BTreeMap<u64, Vec<f64>>, band: Band) -> Vec<(f64, f64, f64)> {
    by.iter()
        .filter_map(|(&x, v)| {
            let (m, s) = band.of(v);
            m.is_finite().then_some((x as f64, m, if s.is_finite() { s } else { 0.0 }))
        })
        .collect()
}

/// What a line figure shows.
pub struct LineFigure<'a> {
    pub metric: &'a str,
    /// the y axis
    pub y_title: &'a str,
    /// the first title line (what is plotted)
    pub title: String,
    /// the second (on what data, how many seeds)
    pub subtitle: &'a str,
    pub x_title: &'a str,
    pub rows: &'a [Row],
    pub layout: &'a Layout,
    /// the band around each line
    pub band: Band,
}

/// label → x → values over seeds, grouped by panel (panels and lines in first-appearance order).
type Panels<'a> = Vec<(String, Vec<(String, &'a BTreeMap<u64, Vec<f64>>)>)>;

fn panels<'a>(fig: &LineFigure<'_>, data: &'a BTreeMap<String, BTreeMap<u64, Vec<f64>>>) -> Panels<'a> {
    // the rows are in the plan's order (cells in config order): keep it for panels and lines
    let mut order: Vec<&str> = Vec::new();
    for r in fig.rows {
        if data.contains_key(&r.label) && !order.contains(&r.label.as_str()) {
            order.push(&r.label);
        }
    }
    let mut out: Panels<'a> = Vec::new();
    for label in order {
        let (panel, key) = fig.layout.parts(label);
        let by = &data[label];
        match out.iter_mut().find(|(p, _)| p == panel) {
            Some((_, v)) => v.push((key.to_string(), by)),
            None => out.push((panel.to_string(), vec![(key.to_string(), by)])),
        }
    }
    out
}

/// The grid for n panels: 1 → 1×1, 2 → 1×2, 3 → 1×3, 4 → 2×2, then rows of 3.
fn grid(n: usize) -> (usize, usize) {
    match n {
        0 | 1 => (1, 1),
        2 => (1, 2),
        3 => (1, 3),
        4 => (2, 2),
        _ => (n.div_ceil(3), 3),
    }
}

/// The pixel size of a line figure with `n` panels.
pub fn line_size(n: usize) -> (u32, u32) {
    let (r, c) = grid(n);
    let (pw, ph) = if n <= 1 { (680, 460) } else { (420, 320) };
    (pw * c as u32 + LEGEND_W, ph * r as u32 + TITLE_H)
}

/// The number of panels `fig` draws.
pub fn panel_count(fig: &LineFigure<'_>) -> usize {
    panels(fig, &series(fig.rows, fig.metric)).len().max(1)
}

fn titled<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    subtitle: &str,
) -> Result<DrawingArea<DB, Shift>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let (top, rest) = root.split_vertically(TITLE_H);
    let (w, _) = top.dim_in_pixel();
    let centre = |size: u32| {
        ("sans-serif", size).into_text_style(&top).pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Top,
        ))
    };
    top.draw_text(title, &centre(21), (w as i32 / 2, 8)).map_err(err)?;
    // a long subtitle (run · data · band) in a one-panel figure is set smaller rather than cut
    // at the figure's edges
    let mut size = 14;
    while size > 9 && top.estimate_text_size(subtitle, &centre(size)).is_ok_and(|(tw, _)| tw + 16 > w) {
        size -= 1;
    }
    top.draw_text(subtitle, &centre(size).color(&RGBColor(90, 90, 90)), (w as i32 / 2, 36)).map_err(err)?;
    Ok(rest)
}

/// `key` in at most `max` characters: its head and its tail around an ellipsis, so that labels
/// that share a long estimator part and differ in their strategy (the end) stay apart.
fn shorten(key: &str, max: usize) -> String {
    let n = key.chars().count();
    if n <= max {
        return key.to_string();
    }
    let tail = (max - 1) / 2 + 1;
    let head = max - 1 - tail;
    key.chars().take(head).chain(['…']).chain(key.chars().skip(n - tail)).collect()
}

/// The legend: one row per colour key used in the figure, in the run's order.
fn legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, layout: &Layout, used: &[String]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    area.draw_text(&layout.legend_title, &("sans-serif", 16).into_text_style(area), (12, 40)).map_err(err)?;
    let mut y = 66;
    for key in layout.keys.iter().filter(|k| used.contains(k)) {
        let (c, dashed) = layout.style(key);
        let line = c.stroke_width(3);
        if dashed {
            for x in (12..44).step_by(10) {
                area.draw(&PathElement::new(vec![(x, y), (x + 6, y)], line)).map_err(err)?;
            }
        } else {
            area.draw(&PathElement::new(vec![(12, y), (44, y)], line)).map_err(err)?;
        }
        let shown = shorten(key, 24);
        let style = ("sans-serif", 14).into_text_style(area).pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Left,
            plotters::style::text_anchor::VPos::Center,
        ));
        area.draw_text(&shown, &style, (52, y)).map_err(err)?;
        y += 24;
    }
    Ok(())
}

/// The mean over seeds against x with the figure's band, small multiples (see the module doc).
pub fn lines<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, fig: &LineFigure<'_>) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let data = series(fig.rows, fig.metric);
    let groups = panels(fig, &data);
    if groups.is_empty() {
        bail!("no values of {}", fig.metric);
    }
    let (xs, ys) = line_ranges(fig, &data)?;
    let rest = titled(&root, &fig.title, fig.subtitle)?;
    let (w, _) = rest.dim_in_pixel();
    let (plots, side) = rest.split_horizontally(w - LEGEND_W);
    let (r, c) = grid(groups.len());
    let areas = plots.split_evenly((r, c));
    let mut used = Vec::new();
    for (area, (panel, lines)) in areas.iter().zip(&groups) {
        let mut chart = line_panel(area, panel, fig, xs, ys)?;
        // a band per line, lighter the more lines share the panel, so lines stay visible through them
        let alpha = (0.22 / (lines.len() as f64).sqrt()).clamp(0.05, 0.16);
        for (key, by) in lines {
            let (colour, dashed) = fig.layout.style(key);
            if !used.contains(key) {
                used.push(key.clone());
            }
            draw_curve(&mut chart, &curve(by, fig.band), (colour, dashed), alpha)?;
        }
    }
    legend(&side, fig.layout, &used)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The axes' ranges shared by every panel of a line figure, (x0, x1) and (y0, y1): x over all
/// the values' counts, y over mean ± band with 5% padding (a flat curve gets ± 0.5).
fn line_ranges(
    fig: &LineFigure<'_>,
    data: &BTreeMap<String, BTreeMap<u64, Vec<f64>>>,
) -> Result<((f64, f64), (f64, f64))> {
    let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut x0, mut x1) = (u64::MAX, 0u64);
    for by in data.values() {
        for (&x, v) in by.iter() {
            let (m, s) = fig.band.of(v);
            let s = if s.is_finite() { s } else { 0.0 };
            if m.is_finite() {
                y0 = y0.min(m - s);
                y1 = y1.max(m + s);
            }
            x0 = x0.min(x);
            x1 = x1.max(x);
        }
    }
    if !(y0.is_finite() && y1.is_finite()) {
        bail!("no finite values of {}", fig.metric);
    }
    if y1 - y0 < 1e-12 {
        y0 -= 0.5;
        y1 += 0.5;
    }
    let pad = 0.05 * (y1 - y0);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let (x0, x1) = (x0 as f64, (x1 as f64).max(x0 as f64 + 1.0));
    Ok(((x0, x1), (y0, y1)))
}

/// A line panel's coordinates: x and y as f64.
type LineCoords = Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>;

/// One panel of a line figure: its caption, axes and mesh drawn, ready for the curves.
fn line_panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    panel: &str,
    fig: &LineFigure<'_>,
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
) -> Result<ChartContext<'a, DB, LineCoords>>
where
    DB::ErrorType: 'static,
{
    let yfmt = tick_formatter(y0, y1);
    // x is a count (samples, chunks): integer ticks, one per value when there are few
    let xfmt = |x: &f64| format!("{:.0}", x.round());
    let few = x1 - x0 <= 20.0;
    let mut b = ChartBuilder::on(area);
    b.margin(10).margin_right(18).x_label_area_size(40).y_label_area_size(64);
    if !panel.is_empty() {
        b.caption(panel, ("sans-serif", 16));
    }
    let mut chart = b.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?;
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(WHITE)
        .bold_line_style(GRID)
        .x_label_formatter(&xfmt)
        .y_label_formatter(&yfmt)
        .x_desc(fig.x_title)
        .y_desc(fig.y_title)
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14));
    if few {
        mesh.x_labels((x1 - x0) as usize + 1);
    } else {
        mesh.x_labels(6);
    }
    mesh.y_labels(7).draw().map_err(err)?;
    Ok(chart)
}

/// One curve of a panel: its band (where any is wider than 0) at opacity `alpha`, the mean as a
/// solid or dashed line, and a dot per point when there are at most 12.
fn draw_curve<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, LineCoords>,
    stats: &[(f64, f64, f64)],
    (colour, dashed): (RGBColor, bool),
    alpha: f64,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    if stats.iter().any(|p| p.2 > 0.0) {
        let band: Vec<(f64, f64)> =
            stats.iter().map(|&(x, m, s)| (x, m + s)).chain(stats.iter().rev().map(|&(x, m, s)| (x, m - s))).collect();
        chart.draw_series(std::iter::once(Polygon::new(band, colour.mix(alpha)))).map_err(err)?;
    }
    let pts = stats.iter().map(|&(x, m, _)| (x, m));
    if dashed {
        chart.draw_series(DashedLineSeries::new(pts, 8, 5, colour.stroke_width(2))).map_err(err)?;
    } else {
        chart.draw_series(LineSeries::new(pts, colour.stroke_width(2))).map_err(err)?;
    }
    if stats.len() <= 12 {
        chart.draw_series(stats.iter().map(|&(x, m, _)| Circle::new((x, m), 3, colour.filled()))).map_err(err)?;
    }
    Ok(())
}

/// Per config: (estimator seconds, cell wall seconds), means over seeds, in the plan's order.
pub type Times = Vec<(String, f64, f64)>;

/// Fig. 3c: time per cell, a horizontal bar per config — the whole cell (light) and the
/// estimator's part of it (dark), mean over seeds, seconds written at the bar's end.
pub fn time_bars<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, times: &Times, subtitle: &str) -> Result<()>
where
    DB::ErrorType: 'static,
{
    if times.is_empty() {
        bail!("no timings");
    }
    let rest = titled(&root, "Time per cell: the estimator's updates (dark) within the whole cell (light)", subtitle)?;
    let n = times.len();
    let xmax = times.iter().map(|t| t.2.max(t.1)).fold(0.0, f64::max).max(1e-9) * 1.18;
    let label_w = times.iter().map(|t| t.0.chars().count()).max().unwrap_or(8).clamp(8, 44) as u32 * 8 + 12;
    let mut chart = ChartBuilder::on(&rest)
        .margin(14)
        .margin_right(30)
        .x_label_area_size(40)
        .y_label_area_size(label_w)
        .build_cartesian_2d(0.0..xmax, -0.5..(n as f64 - 0.5))
        .map_err(err)?;
    let names: Vec<String> = times.iter().map(|t| t.0.clone()).collect();
    let yfmt = |y: &f64| {
        let i = y.round();
        if (y - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
            names[n - 1 - i as usize].clone()
        } else {
            String::new()
        }
    };
    let xfmt = tick_formatter(0.0, xmax);
    chart
        .configure_mesh()
        .disable_y_mesh()
        .light_line_style(WHITE)
        .bold_line_style(GRID)
        .y_labels(2 * n + 1)
        .y_label_formatter(&yfmt)
        .x_label_formatter(&xfmt)
        .x_desc("seconds per cell (mean over seeds)")
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let base = TAB10[0];
    for (i, (_, est, wall)) in times.iter().enumerate() {
        let y = (n - 1 - i) as f64;
        chart
            .draw_series(std::iter::once(Rectangle::new([(0.0, y - 0.35), (*wall, y + 0.35)], base.mix(0.25).filled())))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Rectangle::new([(0.0, y - 0.35), (est.min(*wall), y + 0.35)], base.filled())))
            .map_err(err)?;
        let pct = 100.0 * est / wall.max(1e-12);
        let share = if pct > 0.0 && pct < 0.5 { "<1".to_string() } else { format!("{pct:.0}") };
        let note = format!("{} s ({share}% estimator)", xfmt(wall));
        chart
            .draw_series(std::iter::once(Text::new(note, (*wall + xmax * 0.01, y + 0.18), ("sans-serif", 12))))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Win rates of a deployment run as a heatmap: a row per estimator, a column per strategy (or
/// arm), the chunk win rate written in each cell; chance is 1 / configs.
pub fn win_heatmap<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    wins: &[(String, f64)],
    layout: &Layout,
    subtitle: &str,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let (rows, cols) = heat_axes(wins, layout);
    if wins.is_empty() {
        bail!("no win rates");
    }
    let chance = 1.0 / wins.len() as f64;
    let title = format!("Chunk win rate per estimator × strategy (chance {chance:.3})");
    let rest = titled(&root, &title, subtitle)?;
    let (w, h) = rest.dim_in_pixel();
    let left = rows.iter().map(|r| r.chars().count()).max().unwrap_or(4).clamp(4, 40) as i32 * 8 + 20;
    let (top, bottom) = (30i32, 20i32);
    let cw = ((w as i32 - left - 20) / cols.len().max(1) as i32).max(40);
    let ch = ((h as i32 - top - bottom) / rows.len().max(1) as i32).clamp(30, 80);
    let vmax = wins.iter().map(|x| x.1).fold(chance, f64::max).max(1e-12);
    let text = |s: u32| ("sans-serif", s).into_text_style(&rest);
    for (j, c) in cols.iter().enumerate() {
        let x = left + j as i32 * cw + cw / 2;
        let style = text(13).pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Top,
        ));
        rest.draw_text(c, &style, (x, 6)).map_err(err)?;
    }
    for (i, r) in rows.iter().enumerate() {
        let y = top + i as i32 * ch;
        rest.draw_text(if r.is_empty() { "—" } else { r }, &text(13), (10, y + ch / 2 - 7)).map_err(err)?;
        for (j, c) in cols.iter().enumerate() {
            let x = left + j as i32 * cw;
            let v = wins.iter().find(|(l, _)| layout.parts(l) == (r, c)).map(|x| x.1);
            let fill = match v {
                // white at 0, the palette's blue at the best config
                Some(v) => {
                    let t = (v / vmax).clamp(0.0, 1.0);
                    let mixc = |a: u8| (255.0 - t * (255.0 - a as f64)).round() as u8;
                    RGBColor(mixc(31), mixc(119), mixc(180))
                }
                None => RGBColor(240, 240, 240),
            };
            rest.draw(&Rectangle::new([(x, y), (x + cw - 2, y + ch - 2)], fill.filled())).map_err(err)?;
            if let Some(v) = v {
                let dark = v / vmax > 0.6;
                let style =
                    text(14).color(if dark { &WHITE } else { &BLACK }).pos(plotters::style::text_anchor::Pos::new(
                        plotters::style::text_anchor::HPos::Center,
                        plotters::style::text_anchor::VPos::Center,
                    ));
                rest.draw_text(&format!("{v:.3}"), &style, (x + cw / 2, y + ch / 2)).map_err(err)?;
            }
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// The heatmap's rows (estimators) and columns (strategies), in first-appearance order.
fn heat_axes<'a>(wins: &'a [(String, f64)], layout: &Layout) -> (Vec<&'a str>, Vec<&'a str>) {
    let (mut rows, mut cols): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
    for (l, _) in wins {
        let (r, c) = layout.parts(l);
        if !rows.contains(&r) {
            rows.push(r);
        }
        if !cols.contains(&c) {
            cols.push(c);
        }
    }
    (rows, cols)
}

/// The pixel size of the win-rate heatmap for these wins.
pub fn heatmap_size(wins: &[(String, f64)], layout: &Layout) -> (u32, u32) {
    let (rows, cols) = heat_axes(wins, layout);
    let left = rows.iter().map(|r| r.chars().count()).max().unwrap_or(4).clamp(4, 40) as u32 * 8 + 20;
    ((left + 130 * cols.len().max(1) as u32 + 30).max(900), TITLE_H + 60 + 56 * rows.len().max(1) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_split_into_panel_and_colour_and_colours_are_fixed_per_run() {
        let l = Layout::new(
            ["omd-exact / ucb", "omd-exact / best-two", "sgd lr=0.1 / ucb", "sgd lr=0.1 / best-two"],
            "strategy",
        );
        assert_eq!(l.parts("sgd lr=0.1 / best-two"), ("sgd lr=0.1", "best-two"));
        assert_eq!(l.parts("omd-exact / ucb / rloo"), ("omd-exact", "ucb / rloo"));
        // the same strategy, the same colour, whatever the panel; distinct strategies differ
        assert_eq!(l.style("ucb"), (TAB10[0], false));
        assert_eq!(l.style("best-two"), (TAB10[1], false));
        // labels without " / ": one panel, a colour per label
        let p = Layout::new(["mle", "sgd lr=0.1", "omd-exact"], "strategy");
        assert_eq!(p.parts("sgd lr=0.1"), ("", "sgd lr=0.1"));
        assert_eq!(p.legend_title, "config");
        assert_ne!(p.style("mle"), p.style("omd-exact"));
        // beyond ten keys: the palette again, dashed
        let many: Vec<String> = (0..12).map(|i| format!("c{i}")).collect();
        let m = Layout::new(many.iter().map(String::as_str), "x");
        assert_eq!(m.style("c10"), (TAB10[0], true));
        assert_ne!(m.style("c10"), m.style("c0"));
    }

    #[test]
    fn ticks_have_the_decimals_the_step_needs_and_no_negative_zero() {
        let f = tick_formatter(-1.0, 1.0);
        assert_eq!(f(&-0.0001), "0.0");
        assert_eq!(f(&0.5), "0.5");
        let f = tick_formatter(0.61, 0.64);
        assert_eq!(f(&0.625), "0.625");
        let f = tick_formatter(0.0, 20.0);
        assert_eq!(f(&-0.2), "0");
        assert_eq!(f(&20.0), "20");
        let f = tick_formatter(0.0, 3.0e6);
        assert_eq!(f(&1.5e6), "1.5e6");
    }

    /// Long legend keys keep their ends: two configs of one estimator stay apart (cutting the
    /// tail, as the legend used to, made both `omd-exact lambda=100 / …`).
    #[test]
    fn long_legend_keys_keep_their_head_and_tail() {
        assert_eq!(shorten("omd-exact", 24), "omd-exact");
        let a = shorten("omd-exact lambda=100 / random-pair", 24);
        let b = shorten("omd-exact lambda=100 / best-two", 24);
        assert_eq!(a.chars().count(), 24);
        assert_eq!(a, "omd-exact l… random-pair");
        assert_ne!(a, b);
        assert!(b.starts_with("omd-exact") && b.ends_with("best-two"), "{b}");
    }

    #[test]
    fn grids_grow_in_rows_of_three() {
        assert_eq!(grid(1), (1, 1));
        assert_eq!(grid(4), (2, 2));
        assert_eq!(grid(5), (2, 3));
        assert_eq!(grid(7), (3, 3));
    }
}
