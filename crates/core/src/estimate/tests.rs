use super::*;
use serde_json::json;

const PNG_1024X768: &str = "iVBORw0KGgoAAAANSUhEUgAABAAAAAMACAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==";
const GIF_100X50: &str = "R0lGODlhZAAyAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
const JPEG_640X480: &str = "/9j/4AAQSkZJRgAAAAAAAAAAAAD/wAARCAHgAoADAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
const WEBP_800X600: &str = "UklGRmQAAABXRUJQVlA4WAoAAAAAAAAAHwMAVwIAAAAAAAAAAAAAAA==";

#[test]
fn image_sizes_come_from_their_headers() {
    assert_eq!(image_size(PNG_1024X768), Some((1024, 768)));
    assert_eq!(image_size(GIF_100X50), Some((100, 50)));
    assert_eq!(image_size(JPEG_640X480), Some((640, 480)));
    assert_eq!(image_size(WEBP_800X600), Some((800, 600)));
    assert_eq!(image_size("bm90IGFuIGltYWdl"), None);
    assert_eq!(image_size(""), None);
}

#[test]
fn images_count_by_the_providers_formulas_never_by_their_base64() {
    // OpenAI: 1024×768 → short side 768 → 2×2 tiles → 765; Anthropic: 1024×768/750 =
    // 1049 (rounded up): the larger.
    assert_eq!(image_tokens(Some((1024, 768)), None), 1049);
    // A small image: OpenAI's one tile (255) beats Anthropic's 100×50/750 = 7.
    assert_eq!(image_tokens(Some((100, 50)), None), 255);
    assert_eq!(image_tokens(Some((4000, 3000)), Some("low")), 85);
    assert_eq!(image_tokens(None, None), UNKNOWN_IMAGE_TOKENS);
    // A 300 KB base64 image is about a thousand tokens, not 75 000.
    let big = format!("{PNG_1024X768}{}", "A".repeat(300_000));
    let chat = json!([{"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{big}")}}]);
    let n = value_tokens(&chat);
    assert!((1049..1100).contains(&n), "{n}");
    let messages = json!({"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": JPEG_640X480}});
    assert_eq!(
        value_tokens(&messages),
        image_tokens(Some((640, 480)), None)
    );
    let responses =
        json!({"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "low"});
    assert_eq!(value_tokens(&responses), 85);
    let pdf = json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "A".repeat(200_000)}});
    assert_eq!(value_tokens(&pdf), 3 * PDF_TOKENS_PER_PAGE);
}

#[test]
fn text_is_counted_by_character_class() {
    assert_eq!(text_tokens(""), 0);
    assert_eq!(text_tokens("a"), 1);
    // 1000 ASCII letters: 210; 1000 CJK characters: 880.
    assert_eq!(text_tokens(&"a".repeat(1000)), 210);
    assert_eq!(text_tokens(&"字".repeat(1000)), 880);
    assert_eq!(text_tokens(&"{".repeat(1000)), 780);
}

#[test]
fn tool_calls_results_and_reasoning_echoed_back_count() {
    let args =
        json!({"file_path": "/src/main.rs", "old_string": "x".repeat(40_000), "new_string": "y"})
            .to_string();
    let req: ChatRequest = serde_json::from_value(json!({
        "model": "m",
        "messages": [
            {"role": "user", "content": "edit it"},
            {"role": "assistant", "content": null, "reasoning_content": "I should edit the file.",
             "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "edit_file", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
        ],
        "tools": [{"type": "function", "function": {"name": "edit_file", "description": "Edits a file",
            "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}}}}]
    }))
    .unwrap();
    let n = request_tokens(&req);
    // The 40 KB argument alone is ~8 400 tokens at 0.21 a letter: it is counted.
    assert!(n > 8_400, "{n}");
    assert!(n < 10_000, "{n}");
}

#[test]
fn a_native_body_is_estimated_as_the_source_receives_it() {
    let mut req = ChatRequest::user("stand-in");
    req.native = Some(std::sync::Arc::new(crate::native::NativeRequest {
        body: json!({
            "model": "claude", "max_tokens": 1024,
            "system": [{"type": "text", "text": "You are terse."}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1024X768}}
            ]}, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Let me think.", "signature": "s".repeat(4000)}
            ]}]
        })
        .as_object()
        .unwrap()
        .clone(),
        ..Default::default()
    }));
    let n = request_tokens(&req);
    // The image (1049), the text, the thinking; not the 4000-character signature.
    assert!((1049..1200).contains(&n), "{n}");
}

proptest::proptest! {
    /// Text splits add up (within the rounding of each part), and an inline image is
    /// never counted by its base64, whatever it holds.
    #[test]
    fn text_adds_up_and_images_are_bounded(a in ".{0,200}", b in ".{0,200}", data in "[A-Za-z0-9+/]{0,5000}") {
        let (ta, tb, tab) = (text_tokens(&a), text_tokens(&b), text_tokens(&format!("{a}{b}")));
        proptest::prop_assert!(tab <= ta + tb && tab + 1 >= ta + tb, "{ta} + {tb} vs {tab}");
        let part = json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}});
        proptest::prop_assert!(value_tokens(&part) <= UNKNOWN_IMAGE_TOKENS);
    }
}
