from textkit import camel_to_snake, slugify, snake_to_camel, title_case


def test_slugify_joins_words_with_dashes():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_custom_separator():
    assert slugify("Read the Docs", sep="_") == "read_the_docs"


def test_slugify_drops_leading_and_trailing_punctuation():
    assert slugify("  --Already   spaced--  ") == "already-spaced"


def test_slugify_keeps_digits_and_drops_non_ascii():
    assert slugify("Top 10 café picks") == "top-10-caf-picks"


def test_slugify_single_character_words():
    assert slugify("a b") == "a-b"
    assert slugify("x") == "x"


def test_slugify_empty():
    assert slugify("!!!") == ""


def test_camel_to_snake_simple():
    assert camel_to_snake("parseResponse") == "parse_response"


def test_camel_to_snake_leading_capital():
    assert camel_to_snake("Parser") == "parser"


def test_camel_to_snake_acronym():
    assert camel_to_snake("parseHTTPResponse") == "parse_http_response"
    assert camel_to_snake("HTTPServer") == "http_server"


def test_camel_to_snake_trailing_acronym():
    assert camel_to_snake("useHTTP") == "use_http"


def test_camel_to_snake_digits():
    assert camel_to_snake("base64Encode") == "base64_encode"


def test_snake_to_camel_lower_first():
    assert snake_to_camel("parse_http_response") == "parseHttpResponse"


def test_snake_to_camel_upper_first():
    assert snake_to_camel("parse_http_response", upper_first=True) == "ParseHttpResponse"


def test_snake_to_camel_ignores_extra_underscores():
    assert snake_to_camel("__private__name_") == "privateName"


def test_snake_to_camel_empty():
    assert snake_to_camel("___") == ""


def test_title_case_minor_words_stay_lower():
    assert title_case("the lord of the rings") == "The Lord of the Rings"


def test_title_case_last_word_capitalised():
    assert title_case("what are you looking at") == "What Are You Looking At"


def test_title_case_normalises_case():
    assert title_case("hELLO wORLD") == "Hello World"


def test_title_case_single_minor_word():
    assert title_case("of") == "Of"
