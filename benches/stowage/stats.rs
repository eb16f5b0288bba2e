//! Order statistics. Every figure the bench reports is a median (or another
//! quantile) of many samples: the machines this runs on are shared, and a
//! mean would follow whatever else happened to run at the time.

/// The `q` quantile (0..=1) of `samples`, interpolating between neighbours.
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    assert!(!samples.is_empty(), "no samples");
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

pub fn median(samples: &[f64]) -> f64 {
    quantile(samples, 0.5)
}

pub fn p95(samples: &[f64]) -> f64 {
    quantile(samples, 0.95)
}

/// Per-pair ratios `a[i] / b[i]`.
pub fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}
