//! The status page's plots, drawn on the server as SVG with plotters: a table's rows per
//! minute and how far it lay behind the source, over the board's history.

use std::collections::VecDeque;

use plotters::prelude::*;

use crate::board::Minute;

/// Pixels of one plot.
const SIZE: (u32, u32) = (520, 180);
/// The narrowest time axis, in minutes: a table seen for two minutes is not stretched across
/// the whole plot.
const MIN_SPAN_MINUTES: i64 = 30;

/// The two plots of a table: rows per minute and seconds behind the source.
pub struct TablePlots {
    /// Rows written to bronze per minute.
    pub rows: String,
    /// The most seconds the table lay behind the source, per minute.
    pub behind: String,
}

/// Plots `history` up to the minute `now_minute` (minutes since the Unix epoch).
pub fn table_plots(history: &VecDeque<Minute>, now_minute: i64) -> TablePlots {
    let first = history.front().map_or(now_minute, |minute| minute.minute);
    let start = first.min(now_minute - MIN_SPAN_MINUTES);
    // Every minute from the start: a minute without a batch wrote no rows.
    let mut rows = Vec::new();
    let mut at = history.iter().peekable();
    for minute in start..=now_minute {
        let count = match at.peek() {
            Some(seen) if seen.minute == minute => at.next().map_or(0, |seen| seen.rows),
            _ => 0,
        };
        rows.push((minute, count as f64));
    }
    let behind: Vec<(i64, f64)> = history
        .iter()
        .filter_map(|minute| Some((minute.minute, minute.behind_seconds?)))
        .collect();
    TablePlots {
        rows: draw("rows per minute", "rows", &rows, start..now_minute, true),
        behind: draw(
            "seconds behind the source",
            "seconds",
            &behind,
            start..now_minute,
            false,
        ),
    }
}

/// One plot as an SVG document; a drawing error becomes a one-line SVG saying so.
fn draw(
    title: &str,
    unit: &str,
    points: &[(i64, f64)],
    minutes: std::ops::Range<i64>,
    area: bool,
) -> String {
    let mut svg = String::new();
    let drawn = draw_into(&mut svg, title, unit, points, minutes, area);
    match drawn {
        Ok(()) => svg,
        Err(error) => format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"20\"><text y=\"14\">{}</text></svg>",
            SIZE.0,
            super::html::escape(&format!("{title}: {error}"))
        ),
    }
}

fn draw_into(
    svg: &mut String,
    title: &str,
    unit: &str,
    points: &[(i64, f64)],
    minutes: std::ops::Range<i64>,
    area: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let highest = points.iter().map(|(_, value)| *value).fold(0.0, f64::max);
    // Headroom above the highest value, and a visible axis when everything is zero.
    let top = if highest > 0.0 { highest * 1.15 } else { 1.0 };
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 14))
        .margin(8)
        .x_label_area_size(22)
        .y_label_area_size(52)
        .build_cartesian_2d(minutes, 0.0..top)?;
    chart
        .configure_mesh()
        .x_labels(7)
        .y_labels(5)
        .x_label_formatter(&|minute| clock_label(*minute))
        .y_label_formatter(&|value| axis_number(*value))
        .y_desc(unit)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    let color = RGBColor(31, 119, 180);
    if area {
        chart.draw_series(
            AreaSeries::new(points.iter().copied(), 0.0, color.mix(0.25)).border_style(color),
        )?;
    } else {
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(2),
        ))?;
        chart.draw_series(
            points
                .iter()
                .map(|point| Circle::new(*point, 2, color.filled())),
        )?;
    }
    root.present()?;
    Ok(())
}

/// An axis figure without needless decimals: `4000`, `12`, `0.5`.
fn axis_number(value: f64) -> String {
    if value.abs() >= 10.0 || value.fract() == 0.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// `HH:MM` (UTC) of a minute since the Unix epoch.
fn clock_label(minute: i64) -> String {
    let minute_of_day = minute.rem_euclid(24 * 60);
    format!("{:02}:{:02}", minute_of_day / 60, minute_of_day % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg_with_the_history_drawn() {
        let history = VecDeque::from([
            Minute {
                minute: 1_000,
                rows: 120,
                batches: 3,
                behind_seconds: Some(4.5),
            },
            Minute {
                minute: 1_002,
                rows: 0,
                batches: 1,
                behind_seconds: Some(0.5),
            },
        ]);
        let plots = table_plots(&history, 1_010);
        for svg in [&plots.rows, &plots.behind] {
            assert!(svg.starts_with("<svg"), "{svg}");
            assert!(svg.trim_end().ends_with("</svg>"));
        }
        assert!(plots.rows.contains("rows per minute"));
        assert!(plots.behind.contains("seconds behind the source"));
        // The time axis is labelled in UTC clock time; 1,000 minutes is 16:40.
        assert!(plots.rows.contains("16:"), "{}", plots.rows);
        // The lag line has a marker per minute with a figure.
        assert_eq!(plots.behind.matches("<circle").count(), 2);
    }

    #[test]
    fn an_empty_history_still_draws_its_axes() {
        let plots = table_plots(&VecDeque::new(), 50);
        assert!(plots.rows.contains("<svg"));
        assert!(plots.behind.contains("<svg"));
        assert_eq!(plots.behind.matches("<circle").count(), 0);
    }

    #[test]
    fn axis_figures_carry_no_needless_decimals() {
        assert_eq!(axis_number(4000.0), "4000");
        assert_eq!(axis_number(12.4), "12");
        assert_eq!(axis_number(0.5), "0.5");
        assert_eq!(axis_number(0.0), "0");
    }

    #[test]
    fn clock_labels_wrap_at_midnight() {
        assert_eq!(clock_label(0), "00:00");
        assert_eq!(clock_label(24 * 60 + 61), "01:01");
        assert_eq!(clock_label(-1), "23:59");
    }
}
