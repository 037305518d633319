"""What the manual says once, it says one way (issue 46, item 6): tools on the HTTP API, MXFP4 in
the model table, and `additionalProperties` — which the gateway honours as the manual says."""

from __future__ import annotations

from pathlib import Path

from tessera.stages.text.json_prefix import COMPLETE, INVALID, compile_schema, parse

PAGES = Path(__file__).resolve().parents[1] / "docs" / "pages"


def section(page: str, heading: str) -> str:
    text = (PAGES / page).read_text()
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_the_http_page_does_not_refuse_the_tools_it_serves():
    http = (PAGES / "http.md").read_text()
    cannot = http.split("*Parameters we cannot honour*", 1)[1].split("\n- ", 1)[0]
    assert "`tools` on `/v1/completions`" in cannot  # not on Chat Completions, which takes them
    messages = http.split("- *Messages*:", 1)[1].split("\n- ", 1)[0]
    assert "Tools," not in messages and "Tools work" in messages
    assert "Tool calling" in http and "/v1/messages` takes Anthropic's `tools`" in http


def test_the_tool_section_says_what_unset_additional_properties_means_and_the_gateway_honours_it():
    tools = section("http.md", "## Tool calling")
    assert "without `additionalProperties` allows keys it does\nnot name" in tools
    assert '`"additionalProperties": false`' in tools
    weather = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
    call = '{"city": "Paris", "country": "France"}'
    assert parse(call, compile_schema(weather))[0] == COMPLETE  # unset: a key it does not name is allowed
    assert parse(call, compile_schema({**weather, "additionalProperties": False}))[0] == INVALID


def test_the_model_table_does_not_refuse_mxfp4_which_loads():
    row = next(line for line in (PAGES / "models.md").read_text().splitlines() if line.startswith("| gpt-oss"))
    computes, refuses = row.split(" | ")[1], row.split(" | ")[2]
    assert "MXFP4" in computes and "MXFP4" not in refuses and "mxfp4" not in refuses
