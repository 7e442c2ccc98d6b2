//! The axes of the charts: log axes as linear axes over `log2(x)` / `log10(y)`, with the ticks chosen here.
//!
//! plotters' own log coordinate picks its ticks by decade only, which leaves a narrow range (1.2 … 3 ms) with one
//! tick or none; here they come from 1-2-5 (or 1 … 9) per decade, and powers of two for the batch axis.

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};

/// How an axis maps values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale {
    /// Logarithmic, ticks at powers of two (batch sizes).
    Log2,
    /// Logarithmic, ticks at 1-2-5 per decade.
    Log10,
    /// Linear.
    Linear,
}

impl Scale {
    /// `v` in scale units.
    pub fn fwd(self, v: f64) -> f64 {
        match self {
            Scale::Log2 => v.log2(),
            Scale::Log10 => v.log10(),
            Scale::Linear => v,
        }
    }

    /// Scale units back to a value.
    pub fn inv(self, v: f64) -> f64 {
        match self {
            Scale::Log2 => v.exp2(),
            Scale::Log10 => 10f64.powf(v),
            Scale::Linear => v,
        }
    }

    /// Whether the axis can show `v` (log axes: finite and positive).
    pub fn shows(self, v: f64) -> bool {
        v.is_finite() && (self == Scale::Linear || v > 0.0)
    }
}

/// A linear axis over scale units with the ticks chosen here. (plotters' `with_key_points` wrapper would do, but
/// around an `f64` range it implements no label formatter, the range's own not being forwarded, so the mesh refuses
/// it; this axis takes `DefaultFormatting` and the charts set their own label formatter anyway.)
pub struct Axis {
    /// Range start, scale units.
    pub lo: f64,
    /// Range end, scale units.
    pub hi: f64,
    /// Labelled ticks, scale units.
    pub bold: Vec<f64>,
    /// Unlabelled grid lines, scale units.
    pub light: Vec<f64>,
}

impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let frac = (v - self.lo) / (self.hi - self.lo);
        limit.0 + (f64::from(limit.1 - limit.0) * frac).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.bold.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

/// The axis range in scale units: the values' extent padded a little (a single value gets a span around it).
pub fn span(values: impl Iterator<Item = f64>, scale: Scale) -> Option<(f64, f64)> {
    let v: Vec<f64> = values.filter(|&v| scale.shows(v)).map(|v| scale.fwd(v)).collect();
    let lo = v.iter().copied().reduce(f64::min)?;
    let hi = v.iter().copied().reduce(f64::max)?;
    let (lo, hi) = match scale {
        // One batch size: a factor of two each side.
        Scale::Log2 if hi - lo < 1e-9 => (lo - 1.0, hi + 1.0),
        Scale::Log10 if hi - lo < 1e-9 => (lo - 0.3, hi + 0.3),
        Scale::Linear if hi - lo < 1e-12 => (lo - 0.5 * lo.abs().max(1.0), hi + 0.5 * hi.abs().max(1.0)),
        _ => (lo, hi),
    };
    let pad = match scale {
        Scale::Log2 => 0.3,
        _ => 0.06 * (hi - lo),
    };
    Some((lo - pad, hi + pad))
}

/// Bold and light tick positions (scale units) for the range `lo .. hi` (scale units).
pub fn ticks(scale: Scale, lo: f64, hi: f64) -> (Vec<f64>, Vec<f64>) {
    match scale {
        Scale::Log2 => {
            let (a, b) = (lo.ceil() as i64, hi.floor() as i64);
            let step = ((b - a) / 12 + 1).max(1) as usize;
            ((a..=b).step_by(step).map(|e| e as f64).collect(), Vec::new())
        }
        Scale::Log10 => {
            let in_range = |ms: &[f64]| -> Vec<f64> {
                let decades = lo.floor() as i64..=hi.ceil() as i64;
                let values = decades.flat_map(|d| ms.iter().map(move |m| (m * 10f64.powi(d as i32)).log10()));
                values.filter(|&t| t >= lo && t <= hi).collect()
            };
            let all: Vec<f64> = (1..=9).map(f64::from).collect();
            let mut bold = in_range(&[1.0, 2.0, 5.0]);
            if bold.len() < 3 {
                bold = in_range(&all);
            } else if bold.len() > 12 {
                bold = in_range(&[1.0]);
            }
            let light = in_range(&all)
                .into_iter()
                .filter(|t| !bold.iter().any(|b| (b - t).abs() < 1e-9))
                .collect();
            (bold, light)
        }
        Scale::Linear => {
            let raw = (hi - lo) / 8.0;
            let mag = 10f64.powf(raw.log10().floor());
            let step = [1.0, 2.0, 5.0, 10.0]
                .into_iter()
                .map(|m| m * mag)
                .find(|&s| s >= raw)
                .unwrap_or(10.0 * mag);
            let first = (lo / step).ceil() as i64;
            let last = (hi / step).floor() as i64;
            ((first..=last).map(|i| i as f64 * step).collect(), Vec::new())
        }
    }
}

/// A tick label: three significant digits, no trailing zeros, thousands as `k`.
pub fn tick_label(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{}M", num(v / 1e6, 3))
    } else if v.abs() >= 1e4 {
        format!("{}k", num(v / 1e3, 3))
    } else {
        num(v, 3)
    }
}

/// `v` to `sig` significant digits (whole numbers at or above 10^sig), without trailing zeros.
pub fn num(v: f64, sig: i32) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    if v == 0.0 {
        return "0".into();
    }
    let decimals = (sig - 1 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_plot_numbers_and_ticks() {
        assert_eq!(
            (num(0.0512, 3), num(2.5, 3), num(128.0, 3), num(52134.2, 3)),
            ("0.0512".into(), "2.5".into(), "128".into(), "52134".into())
        );
        assert_eq!((tick_label(20000.0), tick_label(0.5)), ("20k".into(), "0.5".into()));
        let (b, _) = ticks(Scale::Log2, -0.3, 8.3);
        assert_eq!(b, (0..=8).map(f64::from).collect::<Vec<_>>());
        // A narrow log range still gets more than one tick (1 … 9 per decade).
        let (b, _) = ticks(Scale::Log10, 1.2f64.log10(), 3.0f64.log10());
        assert!(b.len() >= 2, "{b:?}");
        let (b, l) = ticks(Scale::Log10, 0.5f64.log10(), 500f64.log10());
        let labels: Vec<String> = b.iter().map(|&t| tick_label(10f64.powf(t))).collect();
        assert_eq!(labels, ["0.5", "1", "2", "5", "10", "20", "50", "100", "200", "500"]);
        assert!(!l.is_empty());
        assert_eq!(ticks(Scale::Linear, 0.0, 1.05).0.len(), 6);
    }
}
