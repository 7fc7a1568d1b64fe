//! What the benchmark plots share: colours, a labelled line with dots, the legend.

use plotters::coord::ranged1d::Ranged;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// Line colours, one per series (repeating).
pub(crate) const PALETTE: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// Draws `points` as a line in `style` with a dot of `color` at each point, under `label` in
/// the legend.
pub(crate) fn line_with_dots<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    style: ShapeStyle,
    label: String,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64>,
{
    chart
        .draw_series(LineSeries::new(points.clone(), style))
        .map_err(|e| anyhow::anyhow!("drawing a line: {e}"))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    chart
        .draw_series(
            points
                .into_iter()
                .map(|(x, y)| Circle::new((x, y), 3, color.filled())),
        )
        .map_err(|e| anyhow::anyhow!("drawing points: {e}"))?;
    Ok(())
}

/// Draws the legend in the upper left corner.
pub(crate) fn legend<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| anyhow::anyhow!("drawing the legend: {e}"))
}
