//! The results: targets (ratios first, then the absolute limits the spec
//! sets) with a verdict each, absolute times as context, and the series the
//! plot is drawn from. Rendered as a text table on stdout, as Markdown for
//! docs/performance.md, and as JSON for the plot script.

use serde_json::{Value, json};

#[derive(Debug, Clone, Copy)]
pub enum Unit {
    /// A dimensionless ratio, shown as `1.23×`.
    Ratio,
    Seconds,
    /// A fraction of one CPU, shown as a percentage.
    Cpu,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Ratio => "ratio",
            Unit::Seconds => "seconds",
            Unit::Cpu => "cpu_fraction",
        }
    }

    pub fn show(self, v: f64) -> String {
        match self {
            Unit::Ratio => format!("{v:.2}×"),
            Unit::Seconds => time(v),
            Unit::Cpu => format!("{:.2}% CPU", v * 100.0),
        }
    }
}

/// A duration in seconds, in the unit that keeps it readable.
pub fn time(s: f64) -> String {
    if s < 1e-6 {
        format!("{:.0} ns", s * 1e9)
    } else if s < 1e-3 {
        format!("{:.2} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

#[derive(Debug, Clone, Copy)]
pub enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Bound {
    fn holds(self, v: f64) -> bool {
        match self {
            Bound::AtMost(b) => v <= b,
            Bound::AtLeast(b) => v >= b,
        }
    }

    fn show(self, unit: Unit) -> String {
        match self {
            Bound::AtMost(b) => format!("≤ {}", unit.show(b)),
            Bound::AtLeast(b) => format!("≥ {}", unit.show(b)),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Row {
    pub id: String,
    pub what: String,
    pub value: f64,
    pub unit: Unit,
    pub bound: Option<Bound>,
    /// How the figure was obtained (sample count, method), and any detail
    /// worth reading next to it.
    pub how: String,
}

impl Row {
    fn verdict(&self) -> &'static str {
        match self.bound {
            Some(b) if b.holds(self.value) => "PASS",
            Some(_) => "FAIL",
            None => "",
        }
    }

    fn json(&self) -> Value {
        json!({
            "id": self.id,
            "what": self.what,
            "value": self.value,
            "unit": self.unit.name(),
            "shown": self.unit.show(self.value),
            "target": self.bound.map(|b| match b {
                Bound::AtMost(v) => json!({"at_most": v}),
                Bound::AtLeast(v) => json!({"at_least": v}),
            }),
            "pass": self.bound.map(|b| b.holds(self.value)),
            "how": self.how,
        })
    }
}

#[derive(Default)]
pub struct Report {
    pub targets: Vec<Row>,
    pub context: Vec<Row>,
    pub series: serde_json::Map<String, Value>,
    pub meta: serde_json::Map<String, Value>,
}

impl Report {
    pub fn target(
        &mut self,
        id: &str,
        what: impl Into<String>,
        value: f64,
        unit: Unit,
        bound: Bound,
        how: impl Into<String>,
    ) {
        let row = Row {
            id: id.into(),
            what: what.into(),
            value,
            unit,
            bound: Some(bound),
            how: how.into(),
        };
        eprintln!(
            "    {}: {} ({}) {}",
            row.what,
            unit.show(value),
            bound.show(unit),
            row.verdict()
        );
        self.targets.push(row);
    }

    pub fn context(
        &mut self,
        id: &str,
        what: impl Into<String>,
        value: f64,
        unit: Unit,
        how: impl Into<String>,
    ) {
        let row = Row {
            id: id.into(),
            what: what.into(),
            value,
            unit,
            bound: None,
            how: how.into(),
        };
        eprintln!("    {}: {}", row.what, unit.show(value));
        self.context.push(row);
    }

    pub fn failures(&self) -> usize {
        self.targets
            .iter()
            .filter(|r| r.verdict() == "FAIL")
            .count()
    }

    /// Targets whose value is a ratio come first: they hold on any machine,
    /// while absolute limits depend on this one.
    fn ordered_targets(&self) -> Vec<&Row> {
        let (mut ratios, absolute): (Vec<&Row>, Vec<&Row>) = self
            .targets
            .iter()
            .partition(|r| matches!(r.unit, Unit::Ratio));
        ratios.extend(absolute);
        ratios
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        let targets: Vec<[String; 5]> = self
            .ordered_targets()
            .into_iter()
            .map(|r| {
                [
                    r.what.clone(),
                    r.unit.show(r.value),
                    r.bound.map(|b| b.show(r.unit)).unwrap_or_default(),
                    r.verdict().into(),
                    r.how.clone(),
                ]
            })
            .collect();
        let context: Vec<[String; 5]> = self
            .context
            .iter()
            .map(|r| {
                [
                    r.what.clone(),
                    r.unit.show(r.value),
                    String::new(),
                    String::new(),
                    r.how.clone(),
                ]
            })
            .collect();
        let all: Vec<&[String; 5]> = targets.iter().chain(&context).collect();
        let w: Vec<usize> = (0..4)
            .map(|i| all.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
            .collect();
        let line = |r: &[String; 5]| {
            format!(
                "  {}{}  {}{}  {}{}  {:<4}  {}\n",
                r[0],
                pad(&r[0], w[0]),
                pad(&r[1], w[1]),
                r[1],
                r[2],
                pad(&r[2], w[2]),
                r[3],
                r[4]
            )
        };
        out.push_str("TARGETS (ratios first)\n");
        for r in &targets {
            out.push_str(&line(r));
        }
        out.push_str("\nCONTEXT (absolute times on this machine)\n");
        for r in &context {
            out.push_str(&line(r));
        }
        out
    }

    pub fn markdown(&self) -> String {
        let mut out =
            String::from("| target | measured | target | result | how |\n|---|---:|---|---|---|\n");
        for r in self.ordered_targets() {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                r.what,
                r.unit.show(r.value),
                r.bound.map(|b| b.show(r.unit)).unwrap_or_default(),
                r.verdict(),
                r.how
            ));
        }
        out.push_str("\n| context | measured | how |\n|---|---:|---|\n");
        for r in &self.context {
            out.push_str(&format!(
                "| {} | {} | {} |\n",
                r.what,
                r.unit.show(r.value),
                r.how
            ));
        }
        out
    }

    pub fn json(&self) -> Value {
        json!({
            "meta": self.meta,
            "targets": self.ordered_targets().into_iter().map(Row::json).collect::<Vec<_>>(),
            "context": self.context.iter().map(Row::json).collect::<Vec<_>>(),
            "series": self.series,
        })
    }
}

fn pad(s: &str, width: usize) -> String {
    " ".repeat(width.saturating_sub(s.chars().count()))
}
