//! Line charts as PNG: a description ([`Chart`]) built by the e2e / kernels modules, drawn with plotters (axes and
//! ticks: [`super::axis`]).

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub use super::axis::{num, Scale};
use super::axis::{span, tick_label, ticks, Axis};
use super::font::FAMILY;

/// Image size, pixels.
pub const SIZE: (u32, u32) = (1000, 650);
/// Width of the legend panel on the right (the legend never covers data).
const LEGEND_W: u32 = 290;
/// Characters per legend line before a label wraps.
const LEGEND_CHARS: usize = 34;

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Line colour.
    pub color: RGBColor,
    /// Dashed (rooflines) rather than solid with point markers (measures).
    pub dashed: bool,
    /// (x, y) points in data units; sorted by x when drawn.
    pub points: Vec<(f64, f64)>,
}

/// A horizontal reference line across the whole chart (copy bandwidth, a target fraction).
#[derive(Clone, Debug)]
pub struct HLine {
    /// Legend text.
    pub label: String,
    /// Its y, data units.
    pub y: f64,
    /// Line colour.
    pub color: RGBColor,
}

/// A line chart: what [`Chart::render`] draws.
#[derive(Clone, Debug)]
pub struct Chart {
    /// First title line.
    pub title: String,
    /// Second title line (device, date, commit).
    pub subtitle: String,
    /// X axis description.
    pub x_desc: String,
    /// Y axis description.
    pub y_desc: String,
    /// X axis scale.
    pub x_scale: Scale,
    /// Y axis scale.
    pub y_scale: Scale,
    /// The lines.
    pub series: Vec<Series>,
    /// Horizontal reference lines.
    pub hlines: Vec<HLine>,
    /// Y values the axis range must include (0 and 1 for a fraction).
    pub y_include: Vec<f64>,
}

/// What [`Chart::prune`] removed.
#[derive(Debug, Default, PartialEq)]
pub struct Pruned {
    /// Labels of the series left without a point.
    pub empty: Vec<String>,
    /// Points the axes cannot show (non-finite, or not positive on a log axis).
    pub dropped: usize,
}

/// Ten colours that stay apart on white (matplotlib's tab10).
const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

/// The `i`-th palette colour (wrapping).
pub fn color(i: usize) -> RGBColor {
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b)
}

/// The colour of reference lines.
pub const REFERENCE: RGBColor = RGBColor(60, 60, 60);

impl Chart {
    /// Drops the points the axes cannot show, then the series left empty (and reference lines off a log axis).
    pub fn prune(&mut self) -> Pruned {
        let (xs, ys) = (self.x_scale, self.y_scale);
        let mut pruned = Pruned::default();
        for s in &mut self.series {
            let before = s.points.len();
            s.points.retain(|&(x, y)| xs.shows(x) && ys.shows(y));
            pruned.dropped += before - s.points.len();
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        pruned.empty = self
            .series
            .iter()
            .filter(|s| s.points.is_empty())
            .map(|s| s.label.clone())
            .collect();
        self.series.retain(|s| !s.points.is_empty());
        self.hlines.retain(|h| ys.shows(h.y));
        pruned
    }

    /// Whether there is no point to draw (after [`Chart::prune`]).
    pub fn is_empty(&self) -> bool {
        self.series.iter().all(|s| s.points.is_empty())
    }

    /// Draws the chart into the PNG `path` (call [`Chart::prune`] first; the font must be registered).
    pub fn render(&self, path: &Path) -> Result<()> {
        self.draw(path)
            .with_context(|| format!("cannot draw {}", path.display()))
    }

    fn draw(&self, path: &Path) -> Result<()> {
        let pts = || self.series.iter().flat_map(|s| s.points.iter());
        let (x_lo, x_hi) = span(pts().map(|p| p.0), self.x_scale).ok_or_else(|| anyhow!("no point to draw"))?;
        let ys = pts().map(|p| p.1).chain(self.hlines.iter().map(|h| h.y));
        let ys = ys.chain(self.y_include.iter().copied().filter(|&y| self.y_scale.shows(y)));
        let (y_lo, y_hi) = span(ys, self.y_scale).ok_or_else(|| anyhow!("no point to draw"))?;
        let (x_ticks, _) = ticks(self.x_scale, x_lo, x_hi);
        let (y_ticks, y_light) = ticks(self.y_scale, y_lo, y_hi);

        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (top, rest) = root.split_vertically(62);
        let centred = |size| TextStyle::from((FAMILY, size).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
        let mid = SIZE.0 as i32 / 2;
        top.draw_text(&self.title, &centred(22), (mid, 8)).map_err(plot_err)?;
        top.draw_text(&self.subtitle, &centred(15).color(&REFERENCE), (mid, 38))
            .map_err(plot_err)?;
        let (plot, legend) = rest.split_horizontally(SIZE.0 - LEGEND_W);

        let mut cc = ChartBuilder::on(&plot)
            .margin_left(12)
            .margin_right(16)
            .margin_top(6)
            .margin_bottom(8)
            .x_label_area_size(52)
            .y_label_area_size(78)
            .build_cartesian_2d(
                Axis {
                    lo: x_lo,
                    hi: x_hi,
                    bold: x_ticks,
                    light: Vec::new(),
                },
                Axis {
                    lo: y_lo,
                    hi: y_hi,
                    bold: y_ticks,
                    light: y_light,
                },
            )
            .map_err(plot_err)?;
        let (xs, ys) = (self.x_scale, self.y_scale);
        cc.configure_mesh()
            .x_desc(self.x_desc.as_str())
            .y_desc(self.y_desc.as_str())
            .x_label_formatter(&|v| tick_label(xs.inv(*v)))
            .y_label_formatter(&|v| tick_label(ys.inv(*v)))
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 16))
            .bold_line_style(RGBColor(205, 205, 205))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(plot_err)?;

        for h in &self.hlines {
            let y = ys.fwd(h.y);
            let style = h.color.stroke_width(2);
            cc.draw_series(DashedLineSeries::new([(x_lo, y), (x_hi, y)], 4, 6, style))
                .map_err(plot_err)?;
        }
        for s in &self.series {
            let p: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (xs.fwd(x), ys.fwd(y))).collect();
            if s.dashed {
                let style = s.color.stroke_width(2);
                cc.draw_series(DashedLineSeries::new(p, 10, 6, style))
                    .map_err(plot_err)?;
            } else {
                cc.draw_series(LineSeries::new(p.iter().copied(), s.color.stroke_width(2)))
                    .map_err(plot_err)?;
                let marker = |c: (f64, f64)| Circle::new(c, 4, s.color.filled());
                cc.draw_series(p.into_iter().map(marker)).map_err(plot_err)?;
            }
        }
        self.draw_legend(&legend)?;
        root.present().map_err(plot_err)?;
        Ok(())
    }

    /// The legend: a line sample and the (wrapped) label of each series, then of each reference line.
    fn draw_legend(&self, area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<()> {
        let text = TextStyle::from((FAMILY, 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        let rows = self
            .series
            .iter()
            .map(|s| (s.label.as_str(), s.color, s.dashed, !s.dashed));
        let rows = rows.chain(self.hlines.iter().map(|h| (h.label.as_str(), h.color, true, false)));
        let mut y = 14;
        for (label, color, dashed, marker) in rows {
            let style = color.stroke_width(2);
            if dashed {
                for (a, b) in [(4, 12), (18, 26), (32, 40)] {
                    area.draw(&PathElement::new(vec![(a, y), (b, y)], style))
                        .map_err(plot_err)?;
                }
            } else {
                area.draw(&PathElement::new(vec![(4, y), (40, y)], style))
                    .map_err(plot_err)?;
            }
            if marker {
                area.draw(&Circle::new((22, y), 4, color.filled())).map_err(plot_err)?;
            }
            for line in wrap(label, LEGEND_CHARS) {
                area.draw_text(&line, &text, (48, y)).map_err(plot_err)?;
                y += 18;
            }
            y += 6;
        }
        Ok(())
    }
}

/// plotters' errors carry the backend's error type; only their message matters here.
fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("{e}")
}

/// Splits `s` at spaces into lines of at most `width` characters (a longer word gets a line of its own).
fn wrap(s: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in s.split_whitespace() {
        match lines.last_mut() {
            Some(l) if l.chars().count() + 1 + word.chars().count() <= width => {
                l.push(' ');
                l.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_plot_legend_labels_wrap() {
        let lines = wrap(
            "fla fused_recurrent_gated_delta_rule (T = 4, final state only)",
            LEGEND_CHARS,
        );
        assert_eq!(
            lines,
            ["fla", "fused_recurrent_gated_delta_rule", "(T = 4, final state only)"]
        );
    }

    #[test]
    fn bench_plot_prune_drops_what_a_log_axis_cannot_show() {
        let s = |label: &str, points: Vec<(f64, f64)>| Series {
            label: label.into(),
            color: color(0),
            dashed: false,
            points,
        };
        let mut c = Chart {
            title: String::new(),
            subtitle: String::new(),
            x_desc: String::new(),
            y_desc: String::new(),
            x_scale: Scale::Log2,
            y_scale: Scale::Log10,
            series: vec![
                s("a", vec![(8.0, 1.0), (1.0, f64::NAN), (0.0, 2.0), (2.0, -1.0)]),
                s("b", vec![(1.0, 0.0)]),
            ],
            hlines: vec![],
            y_include: vec![],
        };
        let p = c.prune();
        assert_eq!(
            p,
            Pruned {
                empty: vec!["b".into()],
                dropped: 4
            }
        );
        assert_eq!((c.series.len(), c.is_empty()), (1, false));
    }
}
