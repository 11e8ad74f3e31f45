//! Screenshots (`/computeruse/screenshot*`): the screen or a region read
//! from the X server, encoded as PNG (full and region) or, compressed, as
//! PNG, JPEG or WebP at a quality and scale; answered as base64 with the
//! pointer's position.

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use base64::Engine as _;
use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::codecs::webp::WebPEncoder;
use image::{ExtendedColorType, ImageEncoder as _, RgbImage};
use serde::Deserialize;
use serde_json::{json, Value};

use super::x11::{Capture, Screen, XError};
use crate::error::Json;
use crate::error::{ApiError, Query};
use crate::AppState;

/// Largest side of a scaled screenshot.
const MAX_SIDE: u32 = 8192;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/computeruse/screenshot", get(full))
        .route("/computeruse/screenshot/region", get(region))
        .route("/computeruse/screenshot/compressed", get(compressed))
        .route(
            "/computeruse/screenshot/region/compressed",
            get(compressed_region),
        )
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScreenshotQuery {
    show_cursor: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegionQuery {
    x: Option<i64>,
    y: Option<i64>,
    width: Option<i64>,
    height: Option<i64>,
    show_cursor: Option<bool>,
    format: Option<String>,
    quality: Option<i64>,
    scale: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompressedQuery {
    show_cursor: Option<bool>,
    format: Option<String>,
    quality: Option<i64>,
    scale: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Format {
    Png,
    Jpeg { quality: u8 },
    WebP,
}

/// How a screenshot is encoded.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Encoding {
    format: Format,
    scale: f64,
}

const PLAIN: Encoding = Encoding {
    format: Format::Png,
    scale: 1.0,
};

fn encoding(
    format: Option<&str>,
    quality: Option<i64>,
    scale: Option<f64>,
) -> Result<Encoding, ApiError> {
    let quality = match quality {
        None => 85,
        Some(q) if (0..=100).contains(&q) => q.max(1) as u8,
        Some(q) => {
            return Err(ApiError::BadRequest(format!(
                "quality must be 0-100, got {q}"
            )))
        }
    };
    let format = match format.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("png") => Format::Png,
        Some("jpeg") | Some("jpg") => Format::Jpeg { quality },
        Some("webp") => Format::WebP,
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "format must be png, jpeg or webp, got {other:?}"
            )))
        }
    };
    let scale = scale.unwrap_or(1.0);
    if !(scale > 0.0 && scale <= 4.0) {
        return Err(ApiError::BadRequest(format!(
            "scale must be above 0 and at most 4, got {scale}"
        )));
    }
    Ok(Encoding { format, scale })
}

/// The rectangle asked for, checked against the screen.
fn rectangle(query: &RegionQuery, screen: (u16, u16)) -> Result<(u16, u16, u16, u16), ApiError> {
    let (Some(x), Some(y), Some(width), Some(height)) =
        (query.x, query.y, query.width, query.height)
    else {
        return Err(ApiError::BadRequest(
            "x, y, width and height are required".into(),
        ));
    };
    let (sw, sh) = (i64::from(screen.0), i64::from(screen.1));
    if x < 0 || y < 0 || width <= 0 || height <= 0 || x + width > sw || y + height > sh {
        return Err(ApiError::BadRequest(format!(
            "the region {width}x{height} at ({x}, {y}) is not inside the {sw}x{sh} screen"
        )));
    }
    Ok((x as u16, y as u16, width as u16, height as u16))
}

fn encode(capture: Capture, encoding: Encoding) -> Result<Vec<u8>, XError> {
    let fail = |e: image::ImageError| XError(format!("encode the screenshot: {e}"));
    let mut capture = capture;
    if encoding.scale != 1.0 {
        let width = ((f64::from(capture.width) * encoding.scale).round() as u32).clamp(1, MAX_SIDE);
        let height =
            ((f64::from(capture.height) * encoding.scale).round() as u32).clamp(1, MAX_SIDE);
        let image = RgbImage::from_raw(capture.width, capture.height, capture.rgb)
            .ok_or_else(|| XError("a capture of the wrong size".into()))?;
        let scaled =
            image::imageops::resize(&image, width, height, image::imageops::FilterType::Triangle);
        capture = Capture {
            width,
            height,
            rgb: scaled.into_raw(),
        };
    }
    let mut out = Vec::with_capacity(capture.rgb.len() / 8);
    let (w, h) = (capture.width, capture.height);
    match encoding.format {
        Format::Png => {
            PngEncoder::new_with_quality(&mut out, CompressionType::Fast, FilterType::Sub)
                .write_image(&capture.rgb, w, h, ExtendedColorType::Rgb8)
                .map_err(fail)?
        }
        Format::Jpeg { quality } => {
            let (Ok(w), Ok(h)) = (u16::try_from(w), u16::try_from(h)) else {
                return Err(XError(format!(
                    "a JPEG is at most 65535 wide and high, not {w}x{h}"
                )));
            };
            jpeg_encoder::Encoder::new(&mut out, quality)
                .encode(&capture.rgb, w, h, jpeg_encoder::ColorType::Rgb)
                .map_err(|e| XError(format!("encode the screenshot: {e}")))?
        }
        Format::WebP => WebPEncoder::new_lossless(&mut out)
            .write_image(&capture.rgb, w, h, ExtendedColorType::Rgb8)
            .map_err(fail)?,
    }
    Ok(out)
}

/// Captures, encodes and answers in the SDK's `ScreenshotResponse` shape.
async fn shoot(
    state: &AppState,
    area: impl FnOnce(&Screen) -> Result<(u16, u16, u16, u16), ApiError> + Send + 'static,
    cursor: bool,
    encoding: Encoding,
) -> Result<Json<Value>, ApiError> {
    let (bytes, (x, y)) = state
        .desktop
        .with_screen(move |s| {
            let (x, y, w, h) = match area(s) {
                Ok(area) => area,
                // Carried out as text; turned back into a 400 below.
                Err(e) => return Ok(Err(e)),
            };
            let capture = s.capture(x, y, w, h, cursor)?;
            let pointer = s.pointer()?;
            Ok(Ok((encode(capture, encoding)?, pointer)))
        })
        .await??;
    Ok(Json(json!({
        "screenshot": base64::engine::general_purpose::STANDARD.encode(&bytes),
        "sizeBytes": bytes.len(),
        "cursorPosition": { "x": x, "y": y },
    })))
}

fn whole(s: &Screen) -> Result<(u16, u16, u16, u16), ApiError> {
    Ok((0, 0, s.width, s.height))
}

async fn full(
    State(state): State<AppState>,
    Query(query): Query<ScreenshotQuery>,
) -> Result<Json<Value>, ApiError> {
    shoot(&state, whole, query.show_cursor.unwrap_or(false), PLAIN).await
}

async fn region(
    State(state): State<AppState>,
    Query(query): Query<RegionQuery>,
) -> Result<Json<Value>, ApiError> {
    let cursor = query.show_cursor.unwrap_or(false);
    shoot(
        &state,
        move |s| rectangle(&query, (s.width, s.height)),
        cursor,
        PLAIN,
    )
    .await
}

async fn compressed(
    State(state): State<AppState>,
    Query(query): Query<CompressedQuery>,
) -> Result<Json<Value>, ApiError> {
    let encoding = encoding(query.format.as_deref(), query.quality, query.scale)?;
    shoot(&state, whole, query.show_cursor.unwrap_or(false), encoding).await
}

async fn compressed_region(
    State(state): State<AppState>,
    Query(query): Query<RegionQuery>,
) -> Result<Json<Value>, ApiError> {
    let encoding = encoding(query.format.as_deref(), query.quality, query.scale)?;
    let cursor = query.show_cursor.unwrap_or(false);
    shoot(
        &state,
        move |s| rectangle(&query, (s.width, s.height)),
        cursor,
        encoding,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(width: u32, height: u32) -> Capture {
        let rgb = (0..width * height * 3).map(|i| (i % 251) as u8).collect();
        Capture { width, height, rgb }
    }

    #[test]
    fn each_format_decodes_to_the_asked_size() {
        for (format, scale, size) in [
            (Some("png"), None, (64, 40)),
            (Some("jpeg"), Some(0.5), (32, 20)),
            (Some("webp"), Some(0.25), (16, 10)),
        ] {
            let encoding = encoding(format, Some(70), scale).unwrap();
            let bytes = encode(capture(64, 40), encoding).unwrap();
            let decoded = if format == Some("jpeg") {
                let mut decoder = zune_jpeg::JpegDecoder::new(std::io::Cursor::new(&bytes));
                decoder.decode_headers().unwrap();
                let info = decoder.info().unwrap();
                (u32::from(info.width), u32::from(info.height))
            } else {
                let decoded = image::load_from_memory(&bytes).unwrap();
                (decoded.width(), decoded.height())
            };
            assert_eq!(decoded, size, "{format:?}");
        }
    }

    #[test]
    fn bad_encodings_are_refused() {
        assert!(encoding(Some("gif"), None, None).is_err());
        assert!(encoding(None, Some(101), None).is_err());
        assert!(encoding(None, None, Some(0.0)).is_err());
        assert!(encoding(None, None, Some(f64::NAN)).is_err());
        assert_eq!(
            encoding(Some("JPG"), Some(0), None).unwrap().format,
            Format::Jpeg { quality: 1 }
        );
    }

    #[test]
    fn regions_must_lie_inside_the_screen() {
        let query = |x, y, w, h| RegionQuery {
            x: Some(x),
            y: Some(y),
            width: Some(w),
            height: Some(h),
            show_cursor: None,
            format: None,
            quality: None,
            scale: None,
        };
        assert_eq!(
            rectangle(&query(10, 20, 100, 50), (1024, 768)).unwrap(),
            (10, 20, 100, 50)
        );
        assert!(rectangle(&query(1000, 0, 100, 50), (1024, 768)).is_err());
        assert!(rectangle(&query(-1, 0, 10, 10), (1024, 768)).is_err());
        assert!(rectangle(&query(0, 0, 0, 10), (1024, 768)).is_err());
    }
}
