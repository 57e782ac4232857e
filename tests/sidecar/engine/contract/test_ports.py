"""The DP port rule and vLLM's side-channel variables, as every component reads them."""

import pytest
from kv_offload_sidecar.engine.contract import ports


def test_the_control_port_of_a_dp_rank_is_the_base_plus_its_global_index():
    assert ports.control_port(5710, 0) == 5710
    assert ports.control_port(5710, 3) == 5713


def test_a_port_past_65535_or_a_negative_index_names_the_variable_to_change():
    with pytest.raises(ValueError, match="VLLM_P2P_SIDE_CHANNEL_PORT"):
        ports.control_port(65535, 1)
    with pytest.raises(ValueError):
        ports.control_port(5710, -1)


def test_side_channel_variables_fall_back_to_vllms_defaults_and_refuse_non_numbers():
    assert ports.env_host({}) == "localhost" and ports.env_base_port({}) == 5710
    env = {"VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.7", "VLLM_P2P_SIDE_CHANNEL_PORT": "6000"}
    assert ports.env_host(env) == "10.0.0.7" and ports.env_base_port(env) == 6000
    with pytest.raises(ValueError, match="VLLM_P2P_SIDE_CHANNEL_PORT='x' is not a port number"):
        ports.env_base_port({"VLLM_P2P_SIDE_CHANNEL_PORT": "x"})
