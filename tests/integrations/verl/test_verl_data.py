"""The verl example's data rows, reward and tools (gear.integrations.verl.data, rewards,
tools).

Split from tests/test_verl.py along its subjects; the shared helpers are
`_verl_helpers`."""

from __future__ import annotations

import asyncio
import json

import pytest

from gear.integrations.verl.config import GearConfigError, check_ground_truth_field


def test_data_rows_reward_and_tools(tmp_path):
    from gear.integrations.verl.data import verl_rows, write_parquet
    from gear.integrations.verl.rewards import compute_score

    rows = verl_rows("tools", "train", n=4)
    path = write_parquet(rows, tmp_path / "train.parquet")
    check_ground_truth_field("extra_info.ground_truth", [str(path)])
    with pytest.raises(GearConfigError, match="has no field 'solution'"):
        check_ground_truth_field("extra_info.solution", [str(path)])
    row = rows[0]
    assert row["agent_name"] == "tool_agent" and row["data_source"] == "gear/tools"
    answer = row["reward_model"]["ground_truth"]
    assert (
        compute_score(row["data_source"], f"<tool_call>x</tool_call>\nAnswer: {answer}", answer)
        == 1.0
    )
    assert compute_score(row["data_source"], "Answer: -1", answer) == 0.0

    pytest.importorskip("verl")
    from gear.integrations.verl.tools import GearCalculatorTool, GearLookupTool

    state = json.loads(row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["state"])

    async def run():
        lookup, calc = GearLookupTool({"type": "native"}), GearCalculatorTool({"type": "native"})
        assert (lookup.name, calc.name) == ("lookup", "calculator")
        results = []
        if state:
            item, count = next(iter(state.items()))
            iid, _ = await lookup.create(create_kwargs={"state": json.dumps(state)})
            results.append(((await lookup.execute(iid, {"item": item}))[0].text, str(count)))
            await lookup.release(iid)
        iid, _ = await calc.create(create_kwargs={})
        results.append(((await calc.execute(iid, {"expression": "12 * (3 + 4)"}))[0].text, "84"))
        return results

    for got, want in asyncio.run(run()):
        assert got == want
