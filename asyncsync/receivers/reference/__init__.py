"""The reference inference server: a small torch causal LM behind aiohttp that receives weights."""
