//! Feeds arbitrary bytes to the wire decoder: it must return (never panic), and whatever it
//! accepts must re-encode to exactly the bytes it consumed.
#![no_main]

use kvx_core::wire::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((message, used)) = Message::decode(data) {
        let again = message.to_bytes().expect("a decoded message re-encodes");
        assert_eq!(again.as_slice(), &data[..used]);
    }
});
