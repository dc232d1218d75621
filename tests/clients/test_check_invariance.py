"""check_invariance against the test server: every check passes on new prompts, and its report says so."""

from __future__ import annotations

from dualserve.clients.check_invariance import main


def test_every_check_passes_on_the_served_default_model(server_url: str, tmp_path, capsys) -> None:
    url = f"{server_url}/v1"
    out = tmp_path / "answers.json"
    code = main(["--url", url, "--url", url, "--prompts", "2", "--concurrency", "3", "--max-tokens", "16",
                 "--drafts", "auto", "suffix", "--json", str(out)])
    report = capsys.readouterr().out
    assert code == 0, report
    assert report.count("identical") == 5 and "2/2 identical" in report and "3/3 identical" in report
    assert out.exists()
