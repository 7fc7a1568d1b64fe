//! A minimal OTLP/HTTP receiver for tests of request traces: it answers every POST with 200 and
//! keeps the request line and body.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// Each request a [`receiver`] took: its request line and its body.
pub type Posted = Arc<Mutex<Vec<(String, String)>>>;

/// Starts a receiver on a free loopback port (a thread that lives as long as the test process);
/// returns its endpoint (`http://127.0.0.1:PORT`) and what it takes.
///
/// # Panics
/// When no loopback port can be bound.
#[must_use]
pub fn receiver() -> (String, Posted) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let endpoint = format!("http://{}", listener.local_addr().expect("bound"));
    let bodies: Posted = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&bodies);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            if let Some(posted) = read_request(&stream) {
                kept.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(posted);
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
            }
        }
    });
    (endpoint, bodies)
}

/// One HTTP request with a `Content-Length` body: its request line and body (`None` on a
/// connection that ends early).
fn read_request(stream: &std::net::TcpStream) -> Option<(String, String)> {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).ok()?;
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some((request_line, String::from_utf8_lossy(&body).into_owned()))
}

/// The spans named `name` in the posted bodies (OTLP JSON), each as the JSON text of its span
/// object, from `{` to its matching `}`.
#[must_use]
pub fn spans_named(posted: &Posted, name: &str) -> Vec<String> {
    let bodies = posted
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut spans = Vec::new();
    let needle = format!("\"name\":\"{name}\"");
    for (_, body) in bodies.iter() {
        let mut from = 0;
        while let Some(at) = body[from..].find(&needle).map(|i| i + from) {
            if let Some(span) = enclosing_object(body, at) {
                spans.push(span.to_owned());
            }
            from = at + needle.len();
        }
    }
    spans
}

/// The JSON object of `text` that encloses byte `at` (strings holding braces aside: OTLP's
/// attribute values here hold none).
fn enclosing_object(text: &str, at: usize) -> Option<&str> {
    let bytes = text.as_bytes();
    let mut depth = 0i32;
    let mut start = None;
    for i in (0..at).rev() {
        match bytes[i] {
            b'}' => depth += 1,
            b'{' if depth == 0 => {
                start = Some(i);
                break;
            }
            b'{' => depth -= 1,
            _ => {}
        }
    }
    let start = start?;
    let mut depth = 0i32;
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..=i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The string value of `"key":"…"` in a span's JSON text.
#[must_use]
pub fn field<'a>(span: &'a str, key: &str) -> Option<&'a str> {
    let needle = format!("\"{key}\":\"");
    let at = span.find(&needle)? + needle.len();
    span[at..].split('"').next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_found_whole_by_name() {
        let posted: Posted = Arc::new(Mutex::new(vec![(
            "POST /v1/traces HTTP/1.1".into(),
            r#"{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"ab","name":"a","attributes":[{"key":"k","value":{"stringValue":"v"}}]},{"traceId":"cd","name":"b"},{"traceId":"ef","name":"a"}]}]}]}"#.into(),
        )]));
        let spans = spans_named(&posted, "a");
        assert_eq!(spans.len(), 2);
        assert_eq!(field(&spans[0], "traceId"), Some("ab"));
        assert!(spans[0].ends_with("}]}"), "{}", spans[0]);
        assert_eq!(field(&spans[1], "traceId"), Some("ef"));
        assert_eq!(spans_named(&posted, "c"), Vec::<String>::new());
    }
}
