//! W3C Trace Context (`traceparent`), the sampler of `OTEL_TRACES_SAMPLER`, and the span
//! ids of a call and its attempts.

/// A trace id (16 bytes, never all zero).
pub type TraceId = [u8; 16];
/// A span id (8 bytes, never all zero).
pub type SpanId = [u8; 8];

/// A parsed `traceparent` header (version `00`, or a later version read as `00`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace.
    pub trace_id: TraceId,
    /// The caller's span.
    pub span_id: SpanId,
    /// The caller's sampled flag.
    pub sampled: bool,
}

fn hex_bytes<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * b.len());
    for x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 0x0f)]));
    }
    s
}

impl TraceParent {
    /// Parses a `traceparent` header as W3C Trace Context level 1 says: lower-case hex,
    /// version `ff` and all-zero ids invalid, a version `00` header exactly 55
    /// characters, a later version's extra fields ignored. `None`: invalid (the call
    /// then starts a trace of its own, as the recommendation says).
    pub fn parse(header: &str) -> Option<TraceParent> {
        let h = header.trim();
        let mut parts = h.splitn(5, '-');
        let version = hex_bytes::<1>(parts.next()?)?[0];
        if version == 0xff {
            return None;
        }
        let trace_id = hex_bytes::<16>(parts.next()?)?;
        let span_id = hex_bytes::<8>(parts.next()?)?;
        let flags_text = parts.next()?;
        let flags = hex_bytes::<1>(flags_text)?[0];
        let rest = parts.next();
        if version == 0 && rest.is_some() {
            return None;
        }
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The header for a request made under span `span_id` of this trace.
    pub fn header(trace_id: &TraceId, span_id: &SpanId, sampled: bool) -> String {
        let mut h = String::with_capacity(55);
        h.push_str("00-");
        h.push_str(&hex(trace_id));
        h.push('-');
        h.push_str(&hex(span_id));
        h.push_str(if sampled { "-01" } else { "-00" });
        h
    }
}

/// `OTEL_TRACES_SAMPLER` (with `OTEL_TRACES_SAMPLER_ARG` for the ratio samplers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    /// `always_on`.
    AlwaysOn,
    /// `always_off`.
    AlwaysOff,
    /// `traceidratio`: this fraction of traces.
    Ratio(f64),
    /// `parentbased_*`: the caller's decision when there is one, else the root's.
    ParentBased(Root),
}

/// The root sampler of a parent-based one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    /// `parentbased_always_on` (the default).
    AlwaysOn,
    /// `parentbased_always_off`.
    AlwaysOff,
    /// `parentbased_traceidratio`.
    Ratio(f64),
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler::ParentBased(Root::AlwaysOn)
    }
}

fn ratio(arg: Option<&str>) -> Result<f64, String> {
    match arg.map(str::trim).filter(|a| !a.is_empty()) {
        None => Ok(1.0),
        Some(a) => match a.parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
            _ => Err(format!(
                "OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], got {a:?}"
            )),
        },
    }
}

impl Sampler {
    /// Reads the sampler's variables; an unknown sampler or a bad ratio is an error
    /// that names it (never a silent default).
    pub fn from_env(name: Option<&str>, arg: Option<&str>) -> Result<Sampler, String> {
        let name = name.map(str::trim).filter(|n| !n.is_empty());
        Ok(match name.unwrap_or("parentbased_always_on") {
            "always_on" => Sampler::AlwaysOn,
            "always_off" => Sampler::AlwaysOff,
            "traceidratio" => Sampler::Ratio(ratio(arg)?),
            "parentbased_always_on" => Sampler::ParentBased(Root::AlwaysOn),
            "parentbased_always_off" => Sampler::ParentBased(Root::AlwaysOff),
            "parentbased_traceidratio" => Sampler::ParentBased(Root::Ratio(ratio(arg)?)),
            other => {
                return Err(format!(
                    "OTEL_TRACES_SAMPLER={other:?} is not one polygw knows (always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio)"
                ))
            }
        })
    }

    /// Whether a trace is recorded: `parent` is the caller's sampled flag, when the
    /// call continues a caller's trace.
    pub fn sampled(&self, trace_id: &TraceId, parent: Option<bool>) -> bool {
        match (self, parent) {
            (Sampler::AlwaysOn, _) => true,
            (Sampler::AlwaysOff, _) => false,
            (Sampler::Ratio(r), _) => by_ratio(trace_id, *r),
            (Sampler::ParentBased(_), Some(p)) => p,
            (Sampler::ParentBased(Root::AlwaysOn), None) => true,
            (Sampler::ParentBased(Root::AlwaysOff), None) => false,
            (Sampler::ParentBased(Root::Ratio(r)), None) => by_ratio(trace_id, *r),
        }
    }
}

/// The trace-id ratio rule of the OpenTelemetry SDKs: the trace id's last 8 bytes, read
/// as a big-endian number and shifted right by one, below `ratio × 2^63`.
fn by_ratio(trace_id: &TraceId, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 {
        return false;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..]);
    let x = u64::from_be_bytes(low) >> 1;
    (x as f64) < ratio * (1u64 << 63) as f64
}

/// FNV-1a, 64 bits: stable across processes and versions (span ids that a proxy sends
/// upstream in `traceparent` and exports later must agree).
fn fnv1a(seed: u64, s: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // A final mix, so that ids differing in one character differ everywhere.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h
}

/// The span id of the call or attempt whose id is `id` (never zero).
pub fn span_id_of(id: &str) -> SpanId {
    let h = fnv1a(0x5350_414e, id).max(1);
    h.to_be_bytes()
}

/// The trace id of a call that continues no caller's trace (never zero).
pub fn trace_id_of(id: &str) -> TraceId {
    let hi = fnv1a(0x5452_4143, id);
    let lo = fnv1a(0x4545_4944, id).max(1);
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&hi.to_be_bytes());
    t[8..].copy_from_slice(&lo.to_be_bytes());
    t
}

/// A call's place in a trace: the caller's, when it sent one, else its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallContext {
    /// The trace.
    pub trace_id: TraceId,
    /// The caller's span (its parent), when it continues a caller's trace.
    pub parent: Option<SpanId>,
    /// The call's own span.
    pub span_id: SpanId,
    /// Whether the trace is recorded.
    pub sampled: bool,
}

impl CallContext {
    /// The context of logical call `logical_call_id`, continuing `parent` (the caller's
    /// `traceparent`) when given, sampled as `sampler` says.
    pub fn new(logical_call_id: &str, parent: Option<TraceParent>, sampler: &Sampler) -> Self {
        let trace_id = parent.map_or_else(|| trace_id_of(logical_call_id), |p| p.trace_id);
        CallContext {
            trace_id,
            parent: parent.map(|p| p.span_id),
            span_id: span_id_of(logical_call_id),
            sampled: sampler.sampled(&trace_id, parent.map(|p| p.sampled)),
        }
    }

    /// The `traceparent` an upstream request of attempt `call_id` carries: the
    /// attempt's span is its parent.
    pub fn upstream_header(&self, call_id: &str) -> String {
        TraceParent::header(&self.trace_id, &span_id_of(call_id), self.sampled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_w3c_examples_parse_and_invalid_headers_do_not() {
        let p = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the spec's example");
        assert_eq!(hex(&p.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&p.span_id), "00f067aa0ba902b7");
        assert!(p.sampled);
        let q = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
            .expect("not sampled");
        assert!(!q.sampled);
        // A later version may carry more fields.
        assert!(TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever"
        )
        .is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn samplers_follow_their_names_and_refuse_unknown_ones() {
        let t = trace_id_of("x");
        assert_eq!(Sampler::from_env(None, None), Ok(Sampler::default()));
        let pb = Sampler::from_env(Some("parentbased_always_on"), None).unwrap();
        assert!(pb.sampled(&t, None));
        assert!(!pb.sampled(&t, Some(false)));
        assert!(!Sampler::from_env(Some("always_off"), None)
            .unwrap()
            .sampled(&t, Some(true)));
        assert!(Sampler::from_env(Some("always_on"), None)
            .unwrap()
            .sampled(&t, Some(false)));
        let e = Sampler::from_env(Some("jaeger_remote"), None).unwrap_err();
        assert!(e.contains("jaeger_remote"), "{e}");
        let e = Sampler::from_env(Some("traceidratio"), Some("1.5")).unwrap_err();
        assert!(e.contains("1.5"), "{e}");
        assert_eq!(
            Sampler::from_env(Some("parentbased_traceidratio"), Some("0.25")),
            Ok(Sampler::ParentBased(Root::Ratio(0.25)))
        );
    }

    #[test]
    fn a_ratio_keeps_about_its_share_of_traces() {
        let s = Sampler::Ratio(0.25);
        let kept = (0..4000)
            .filter(|i| s.sampled(&trace_id_of(&format!("call-{i}")), None))
            .count();
        assert!((850..1150).contains(&kept), "{kept} of 4000");
    }

    #[test]
    fn a_call_continues_its_callers_trace_and_names_its_attempts_spans() {
        let parent = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let c = CallContext::new("call-1", parent, &Sampler::default());
        assert_eq!(hex(&c.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.parent, Some(parent.unwrap().span_id));
        let h = c.upstream_header("attempt-1");
        let up = TraceParent::parse(&h).expect("a valid header");
        assert_eq!(up.trace_id, c.trace_id);
        assert_eq!(up.span_id, span_id_of("attempt-1"));
        assert_ne!(up.span_id, c.span_id);
        // Without a caller: a trace of its own, the same every time for the same id.
        let own = CallContext::new("call-1", None, &Sampler::default());
        assert_eq!(own.trace_id, trace_id_of("call-1"));
        assert_eq!(own.parent, None);
        assert!(own.sampled);
    }

    proptest! {
        #[test]
        fn a_header_reads_back_as_written(t in any::<[u8; 16]>(), s in any::<[u8; 8]>(), sampled: bool) {
            prop_assume!(t != [0; 16] && s != [0; 8]);
            let h = TraceParent::header(&t, &s, sampled);
            prop_assert_eq!(h.len(), 55);
            prop_assert_eq!(TraceParent::parse(&h), Some(TraceParent { trace_id: t, span_id: s, sampled }));
        }

        #[test]
        fn ids_are_never_zero_and_differ_by_id(a in ".{0,40}", b in ".{0,40}") {
            prop_assert_ne!(span_id_of(&a), [0; 8]);
            prop_assert_ne!(trace_id_of(&a), [0; 16]);
            if a != b {
                prop_assert_ne!(span_id_of(&a), span_id_of(&b));
            }
        }
    }
}
