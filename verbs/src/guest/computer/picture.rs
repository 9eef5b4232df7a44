//! Screenshots as a model takes them: scaled down to the size computer-use models are trained
//! on (XGA, WXGA or FWXGA, whichever has the screen's shape) and PNG-encoded; and the
//! coordinates a model gives in that picture scaled back to the screen's.

use image::{ImageEncoder, RgbImage, imageops};

use super::xwd::Rgb;
use crate::{Result, VerbError};

/// The sizes a screenshot is scaled down to for a model, by shape: XGA (4:3), WXGA (16:10),
/// FWXGA (16:9), as Anthropic's computer-use guidance has them.
pub const TARGETS: [(u32, u32); 3] = [(1024, 768), (1280, 800), (1366, 768)];

/// A screen's size and the size it is shown to a model at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Scale {
    /// The screen's size in pixels.
    pub screen: (u32, u32),
    /// The size it is shown at (the same when it is no larger than its target).
    pub shown: (u32, u32),
}

impl Scale {
    /// No scaling: the picture is the screen (a person's `boxery screenshot`).
    pub fn none(width: u32, height: u32) -> Scale {
        Scale {
            screen: (width, height),
            shown: (width, height),
        }
    }

    /// Scaled for a model: to the target of the closest shape, when the screen is larger.
    pub fn for_model(width: u32, height: u32) -> Scale {
        let shape = width as f64 / height.max(1) as f64;
        let (tw, th) = TARGETS
            .iter()
            .copied()
            .min_by(|a, b| {
                let d = |t: &(u32, u32)| (t.0 as f64 / t.1 as f64 - shape).abs();
                d(a).total_cmp(&d(b))
            })
            .expect("targets");
        if width <= tw && height <= th {
            return Scale::none(width, height);
        }
        let f = (tw as f64 / width as f64).min(th as f64 / height as f64);
        Scale {
            screen: (width, height),
            shown: (
                ((width as f64 * f).round() as u32).max(1),
                ((height as f64 * f).round() as u32).max(1),
            ),
        }
    }

    /// A point of the shown picture as a point of the screen; a point off the picture is
    /// refused, saying its size.
    pub fn to_screen(&self, what: &str, [x, y]: [i64; 2]) -> Result<(u32, u32)> {
        let (sw, sh) = self.shown;
        if x < 0 || y < 0 || x >= sw as i64 || y >= sh as i64 {
            return Err(VerbError::invalid(format!(
                "{what} ({x}, {y}) is off the screen, which is {sw}×{sh} (x 0..{}, y 0..{}); nothing was sent",
                sw - 1,
                sh - 1
            )));
        }
        let map = |v: i64, shown: u32, screen: u32| {
            (((v as f64 + 0.5) * screen as f64 / shown as f64) as u32).min(screen - 1)
        };
        Ok((map(x, sw, self.screen.0), map(y, sh, self.screen.1)))
    }

    /// A point of the screen as a point of the shown picture.
    pub fn to_shown(&self, (x, y): (u32, u32)) -> (u32, u32) {
        let map = |v: u32, shown: u32, screen: u32| {
            ((v as f64 * shown as f64 / screen as f64) as u32).min(shown.saturating_sub(1))
        };
        (
            map(x, self.shown.0, self.screen.0),
            map(y, self.shown.1, self.screen.1),
        )
    }
}

/// A PNG picture decoded to RGB (the hypervisor's screendump).
pub fn from_png(png: &[u8]) -> Result<Rgb> {
    let img = image::load_from_memory_with_format(png, image::ImageFormat::Png)
        .map_err(|e| VerbError::failed(format!("the VM's screen is not a PNG picture: {e}")))?
        .into_rgb8();
    Ok(Rgb {
        width: img.width(),
        height: img.height(),
        pixels: img.into_raw(),
    })
}

/// `rgb` at `scale.shown`, PNG-encoded (fast compression: screens are mostly flat colour).
pub fn png(rgb: Rgb, scale: Scale) -> Result<Vec<u8>> {
    let img = RgbImage::from_raw(rgb.width, rgb.height, rgb.pixels)
        .ok_or_else(|| VerbError::failed("a picture whose pixels do not fill its size"))?;
    let img = if scale.shown == (rgb.width, rgb.height) {
        img
    } else {
        imageops::resize(
            &img,
            scale.shown.0,
            scale.shown.1,
            imageops::FilterType::Triangle,
        )
    };
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new_with_quality(
        &mut out,
        image::codecs::png::CompressionType::Fast,
        image::codecs::png::FilterType::Adaptive,
    )
    .write_image(
        img.as_raw(),
        img.width(),
        img.height(),
        image::ExtendedColorType::Rgb8,
    )
    .map_err(|e| VerbError::failed(format!("encoding the screenshot: {e}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_screen_is_scaled_to_the_target_of_its_shape_only_when_larger() {
        assert_eq!(Scale::for_model(1280, 800).shown, (1280, 800));
        assert_eq!(Scale::for_model(800, 600).shown, (800, 600));
        assert_eq!(Scale::for_model(1920, 1080).shown, (1365, 768));
        assert_eq!(Scale::for_model(1366, 768).shown, (1366, 768));
        assert_eq!(Scale::for_model(2560, 1600).shown, (1280, 800));
        assert_eq!(Scale::for_model(1600, 1200).shown, (1024, 768));
        assert_eq!(Scale::for_model(720, 400).shown, (720, 400));
    }

    #[test]
    fn coordinates_round_trip_and_the_edges_stay_on_the_screen() {
        let s = Scale::for_model(1920, 1080);
        assert_eq!(s.to_screen("x", [0, 0]).unwrap(), (0, 0));
        let (x, y) = s.to_screen("x", [1364, 767]).unwrap();
        assert!(x <= 1919 && y <= 1079 && x >= 1915 && y >= 1075, "{x},{y}");
        for p in [[0, 0], [683, 384], [1364, 767], [1, 1]] {
            let back = s.to_shown(s.to_screen("x", p).unwrap());
            assert_eq!([back.0 as i64, back.1 as i64], p);
        }
        for off in [[-1, 0], [0, -1], [1365, 0], [0, 768], [i64::MAX, 0]] {
            let e = s.to_screen("coordinate", off).unwrap_err().to_string();
            assert!(
                e.contains("off the screen") && e.contains("1365×768"),
                "{e}"
            );
        }
        let same = Scale::none(1280, 800);
        assert_eq!(same.to_screen("x", [1279, 799]).unwrap(), (1279, 799));
    }

    #[test]
    fn a_picture_is_encoded_at_its_shown_size() {
        let rgb = Rgb {
            width: 1920,
            height: 1080,
            pixels: vec![200; 1920 * 1080 * 3],
        };
        let png = png(rgb, Scale::for_model(1920, 1080)).unwrap();
        let back = from_png(&png).unwrap();
        assert_eq!((back.width, back.height), (1365, 768));
        assert!(from_png(b"not a png").is_err());
    }
}
