//! `created_at` as text: ISO-8601 UTC with milliseconds (`2026-12-02T11:32:08.123Z`),
//! converted with the civil-from-days algorithm (no date crate).
//!
//! The format is fixed-width for years 0000–9999, so text order is time order (SQLite
//! compares `created_at` as text). Milliseconds outside that range are clamped to it.

/// Milliseconds in a day.
const DAY_MS: i64 = 86_400_000;

/// Days from 1970-01-01 to a proleptic Gregorian date.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian date of a day count from 1970-01-01.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The smallest instant the text format holds (0000-01-01T00:00:00.000Z).
pub(crate) fn min_ms() -> i64 {
    days_from_civil(0, 1, 1) * DAY_MS
}

/// The largest instant the text format holds (9999-12-31T23:59:59.999Z).
pub(crate) fn max_ms() -> i64 {
    days_from_civil(9999, 12, 31) * DAY_MS + DAY_MS - 1
}

/// Formats ms since the Unix epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ` (clamped to years
/// 0000–9999).
pub fn format_utc_ms(unix_ms: i64) -> String {
    let ms = unix_ms.clamp(min_ms(), max_ms());
    let days = ms.div_euclid(DAY_MS);
    let in_day = ms.rem_euclid(DAY_MS);
    let (y, mo, d) = civil_from_days(days);
    let (h, rest) = (in_day / 3_600_000, in_day % 3_600_000);
    let (mi, rest) = (rest / 60_000, rest % 60_000);
    let (s, milli) = (rest / 1000, rest % 1000);
    // Written digit by digit: every row formats one or two of these, and `format!`
    // costs several times as much (issue 42). All parts are in range (clamped above).
    let mut out = *b"0000-00-00T00:00:00.000Z";
    let mut put = |at: usize, width: usize, mut v: i64| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, 4, y);
    put(5, 2, mo);
    put(8, 2, d);
    put(11, 2, h);
    put(14, 2, mi);
    put(17, 2, s);
    put(20, 3, milli);
    out.iter().map(|&b| char::from(b)).collect()
}

/// Parses what [`format_utc_ms`] writes. Also accepts a space instead of `T`, no or any
/// number of fractional digits (truncated to ms), and `Z`, `+00:00` or `+0000` as the
/// zone; anything else is `None`.
pub fn parse_utc_ms(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let part = b.get(from..from + len)?;
        part.iter().try_fold(0i64, |acc, c| {
            c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
        })
    };
    if b.len() < 19 || b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    if b[10] != b'T' && b[10] != b't' && b[10] != b' ' {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    let mut i = 19;
    let mut milli = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 3 {
                milli = milli * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        let digits = i - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..3 {
            milli *= 10;
        }
    }
    match &b[i..] {
        b"Z" | b"z" | b"+00:00" | b"+0000" | b"+00" => {}
        _ => return None,
    }
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        _ => return None,
    };
    if day < 1 || day > days_in_month || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(days * DAY_MS + hour * 3_600_000 + minute * 60_000 + second * 1000 + milli)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants() {
        let table = [
            (0, "1970-01-01T00:00:00.000Z"),
            (1, "1970-01-01T00:00:00.001Z"),
            (-1, "1969-12-31T23:59:59.999Z"),
            (951_782_400_000, "2000-02-29T00:00:00.000Z"),
            (1_796_211_128_123, "2026-12-02T11:32:08.123Z"),
            (4_102_444_799_999, "2099-12-31T23:59:59.999Z"),
            (-62_167_219_200_000, "0000-01-01T00:00:00.000Z"),
            (253_402_300_799_999, "9999-12-31T23:59:59.999Z"),
        ];
        for (ms, text) in table {
            assert_eq!(format_utc_ms(ms), text, "{ms}");
            assert_eq!(parse_utc_ms(text), Some(ms), "{text}");
        }
        assert_eq!(min_ms(), -62_167_219_200_000);
        assert_eq!(max_ms(), 253_402_300_799_999);
    }

    #[test]
    fn round_trip_and_order_over_a_wide_range() {
        // A stride that is not a multiple of a day, a second or a ms-per-minute, from
        // year 0 to 9999: every value round-trips and text order is numeric order.
        let mut ms = min_ms();
        let mut prev: Option<String> = None;
        let mut n = 0;
        while ms <= max_ms() {
            let text = format_utc_ms(ms);
            assert_eq!(text.len(), 24, "{text}");
            assert_eq!(parse_utc_ms(&text), Some(ms), "{text}");
            if let Some(p) = &prev {
                assert!(p < &text, "{p} !< {text}");
            }
            prev = Some(text);
            ms += 3_155_760_012_347; // ≈ 100 years and some
            n += 1;
        }
        assert!(n > 90);
    }

    #[test]
    fn out_of_range_is_clamped() {
        assert_eq!(format_utc_ms(i64::MIN), "0000-01-01T00:00:00.000Z");
        assert_eq!(format_utc_ms(i64::MAX), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn lenient_parse_and_rejections() {
        let want = Some(1_796_211_128_123);
        assert_eq!(parse_utc_ms("2026-12-02 11:32:08.123Z"), want);
        assert_eq!(parse_utc_ms("2026-12-02T11:32:08.123456+00:00"), want);
        assert_eq!(
            parse_utc_ms("2026-12-02T11:32:08.12Z"),
            Some(1_796_211_128_120)
        );
        assert_eq!(
            parse_utc_ms("2026-12-02T11:32:08Z"),
            Some(1_796_211_128_000)
        );
        for bad in [
            "",
            "2026-12-02",
            "2026-12-02T11:32:08.123",
            "2026-12-02T11:32:08.123+01:00",
            "2026-13-02T11:32:08.123Z",
            "2026-02-29T11:32:08.123Z",
            "2026-12-02T24:00:00.000Z",
            "2026-12-02T11:32:08.Z",
            "2026/12/02T11:32:08.123Z",
        ] {
            assert_eq!(parse_utc_ms(bad), None, "{bad:?}");
        }
        assert_eq!(
            parse_utc_ms("2024-02-29T00:00:00.000Z"),
            Some(1_709_164_800_000)
        );
    }
}
