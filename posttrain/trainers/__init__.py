"""The trainers around the RL loop: SFT, DPO (and its pairs), reward models, RFT and A*-PO's values."""
